"""The Prometheus metrics of DESIGN §3, one definition shared by all three services.

Each service makes one ``Metrics`` on its own registry and updates what it observes: the target
its verify time, the draft and the gateway the speculation counters, the gateway the latencies.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_PHASE_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 1.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


@dataclass
class Metrics:
    registry: CollectorRegistry
    num_drafts: Counter
    num_draft_tokens: Counter
    num_accepted_tokens: Counter
    num_accepted_tokens_per_pos: Counter
    acceptance_rate: Gauge
    verify_duration: Histogram
    round_phase: Histogram
    pipelined_blocks: Counter
    pass_sessions: Histogram
    prefix_cache_tokens: Counter
    time_to_first_token: Histogram
    inter_token_latency: Histogram
    e2e_request_latency: Histogram
    session_fallbacks: Counter
    sessions_active: Gauge
    speculation_prior: Gauge
    requests: Counter
    session_failovers: Counter
    pool_sessions: Gauge

    def record_round(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Counts one speculation round and refreshes the running acceptance rate."""
        self.num_drafts.inc()
        self.num_draft_tokens.inc(num_draft_tokens)
        self.num_accepted_tokens.inc(num_accepted)
        for position in range(num_accepted):
            self.num_accepted_tokens_per_pos.labels(position=str(position)).inc()
        drafted = self.num_draft_tokens._value.get()
        if drafted:
            self.acceptance_rate.set(self.num_accepted_tokens._value.get() / drafted)

    def record_phases(self, propose: float, verify: float, transport: float, other: float) -> None:
        """One verified round's wall time by phase (``tandem_round_phase_seconds``)."""
        for phase, seconds in (("propose", propose), ("verify", verify), ("transport", transport), ("other", other)):
            self.round_phase.labels(phase=phase).observe(max(0.0, seconds))

    def record_prior(self, band: str, load: str, ratio: float) -> None:
        """The temperature prior's average for ``band`` at ``load`` (gateway.prior calls this after each report)."""
        self.speculation_prior.labels(temperature=band, load=load).set(ratio)


# Set by ``tandem serve``'s supervisor on a child it restarted: how many times it did.
RESTARTS_ENV = "TANDEM_SUPERVISOR_RESTARTS"


def make_metrics(service: str, registry: CollectorRegistry | None = None) -> Metrics:
    """All DESIGN §3 metrics on a fresh registry (one per service, so tests can make many)."""
    reg = registry if registry is not None else CollectorRegistry()
    restarts = Gauge(
        "tandem_process_restarts",
        "Times tandem serve's supervisor restarted this service after it exited (0 elsewhere: an "
        "orchestrator counts its own, e.g. Kubernetes' kube_pod_container_status_restarts_total)",
        registry=reg,
    )
    try:
        restarts.set(max(0, int(os.environ.get(RESTARTS_ENV, "0"))))
    except ValueError:
        restarts.set(0)
    return Metrics(
        registry=reg,
        num_drafts=Counter("tandem_spec_decode_num_drafts", "Speculation rounds (draft blocks verified)", registry=reg),
        num_draft_tokens=Counter("tandem_spec_decode_num_draft_tokens", "Draft tokens proposed", registry=reg),
        num_accepted_tokens=Counter("tandem_spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=reg),
        num_accepted_tokens_per_pos=Counter(
            "tandem_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the block",
            ["position"],
            registry=reg,
        ),
        acceptance_rate=Gauge(
            "tandem_spec_decode_acceptance_rate", "Accepted / proposed draft tokens since start", registry=reg
        ),
        verify_duration=Histogram(
            "tandem_verify_duration_seconds", "Time to verify one draft block", buckets=_LATENCY_BUCKETS, registry=reg
        ),
        round_phase=Histogram(
            "tandem_round_phase_seconds",
            "Where a speculation round's wall time goes, as the draft sees it: propose (the proposer's "
            "work, thread hops included), verify (the target's pass, as its verdict reports it), "
            "transport (the Verify round trip beyond that pass) and other (the rest of the round)",
            ["phase"],
            buckets=_PHASE_BUCKETS,
            registry=reg,
        ),
        pipelined_blocks=Counter(
            "tandem_spec_decode_pipelined_blocks",
            "Blocks sent before the verdict of the block before them (--pipeline-depth above 1), by what "
            "became of the assumption they were drafted on: verified (it held) or stale (it did not: "
            "answered without a pass, drafted anew from the verdict)",
            ["outcome"],
            registry=reg,
        ),
        pass_sessions=Histogram(
            "tandem_target_pass_sessions",
            "Sessions whose verify blocks or decode steps shared one target forward pass",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32),
            registry=reg,
        ),
        prefix_cache_tokens=Counter(
            "tandem_target_prompt_tokens",
            "Prompt tokens a target took: their KV cache copied from an ended session's (hit) or prefilled",
            ["outcome"],
            registry=reg,
        ),
        time_to_first_token=Histogram(
            "tandem_time_to_first_token_seconds", "Request start to first token", buckets=_LATENCY_BUCKETS, registry=reg
        ),
        inter_token_latency=Histogram(
            "tandem_inter_token_latency_seconds", "Gap between streamed tokens", buckets=_LATENCY_BUCKETS, registry=reg
        ),
        e2e_request_latency=Histogram(
            "tandem_e2e_request_latency_seconds", "Request start to last token", buckets=_E2E_BUCKETS, registry=reg
        ),
        session_fallbacks=Counter(
            "tandem_session_fallbacks", "Sessions switched to autoregressive decoding", ["reason"], registry=reg
        ),
        sessions_active=Gauge("tandem_sessions_active", "Sessions in progress", ["mode"], registry=reg),
        speculation_prior=Gauge(
            "tandem_speculation_prior_ratio",
            "Speculative seconds per token over autoregressive ones, as measured at each temperature band "
            "and load (sessions in progress per target; above 1: new sessions there decode autoregressively, "
            "gateway.prior)",
            ["temperature", "load"],
            registry=reg,
        ),
        requests=Counter("tandem_requests", "Requests finished, by status", ["status"], registry=reg),
        session_failovers=Counter(
            "tandem_session_failovers",
            "Sessions moved to another target because theirs died, hung or lost them (gateway.target_session)",
            ["reason"],
            registry=reg,
        ),
        pool_sessions=Gauge(
            "tandem_pool_sessions", "Sessions (targets) or speculative legs (drafts) this gateway placed on each "
            "pool member", ["role", "address"], registry=reg,
        ),
    )


def serve_metrics(metrics: Metrics, host: str, port: int) -> None:
    """Exposes the registry over HTTP (draft and target); port 0 disables it."""
    if port:
        start_http_server(port, addr=host, registry=metrics.registry)

"""Settings of each service: pydantic-settings, so every flag has an env twin ``TANDEM_<FLAG>``.

CLI flags are parsed by ``tandem.cli`` and passed as init values, which win over the environment;
``TARGET_MODEL`` and ``DRAFT_MODEL`` are accepted besides ``TANDEM_TARGET_MODEL`` / ``TANDEM_DRAFT_MODEL``.
"""

from __future__ import annotations

from pydantic import AfterValidator, AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from typing import Annotated, Literal

from tandem.models import DEFAULT_TARGET
from tandem.rpc import addresses


def _pool(spec: str) -> str:
    addresses.parse(spec)  # ValueError (a settings error) for an entry that is not host:port
    return spec


# A pool's comma-separated host:port entries (tandem.rpc.addresses).
PoolAddresses = Annotated[str, AfterValidator(_pool)]

# "auto": prompt lookup first and the shipped eagle head where lookup finds nothing (ngram+eagle),
# for a target tandem ships a head for; prompt lookup alone (ngram) for any other target
# (tandem.models.resolve_draft_spec). Figures: docs/drafting.md#default-draft.
DEFAULT_DRAFT = "auto"
# The most drafts a block carries. A CPU pass reads the weights once whatever the rows
# (tandem.cpu.linear), so long blocks are cheap and prompt lookup's long matches pay; the eagle
# head drafts at most eagle_k of them and the draft service cuts blocks where they stop paying.
# Figures: docs/drafting.md#k.
DEFAULT_K = 7
DRAFT_HELP = (
    "'auto' (ngram+eagle where tandem ships an eagle head for the target, else ngram), a draft SPEC, 'eagle' "
    "(the head shipped for the target), an eagle head directory, 'ngram', or 'ngram+eagle' / 'ngram+HEAD_DIR' "
    "(prompt lookup first, the eagle head where it finds no match)"
)

PORTS = {
    "gateway_http": 8000,
    "gateway_grpc": 50051,
    "draft_grpc": 50052,
    "target_grpc": 50053,
    "draft_metrics": 9052,
    "target_metrics": 9053,
}


def _model_field(name: str, default: str, description: str):
    return Field(
        default,
        description=description,
        validation_alias=AliasChoices(name, f"tandem_{name}", name.upper(), f"TANDEM_{name.upper()}"),
    )


def _api_keys_field():
    """``--api-key KEY`` (repeatable) / ``TANDEM_API_KEYS`` (comma-separated): kept out of the
    settings' repr, so a logged settings object shows no key."""
    return Field(
        "",
        description="an API key clients must send (Authorization: Bearer KEY); repeat the flag for several "
        "(env TANDEM_API_KEYS, comma-separated); none: no key required",
        validation_alias=AliasChoices("api_keys", "TANDEM_API_KEYS"),
        repr=False,
        json_schema_extra={"flag": "--api-key", "repeatable": True},
    )


def _internal_token_field():
    return Field(
        "",
        description="a shared secret every call between tandem services carries; draft and target refuse calls "
        "without it (UNAUTHENTICATED). Prefer the env twin: a flag shows in the process list",
        repr=False,
    )


class _Base(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="ignore", populate_by_name=True)

    host: str = Field("127.0.0.1", description="address to bind")
    # Securing the gRPC hops (tandem.rpc.security; docs/security.md)
    tls_cert: str | None = Field(
        None, description="PEM certificate (chain) this service presents: as a gRPC server, and to the services "
        "it calls when they require client certificates"
    )
    tls_key: str | None = Field(None, description="the PEM private key of --tls-cert")
    tls_ca: str | None = Field(
        None, description="PEM CA bundle the certificates of the services it calls must be signed by; on a server "
        "with --tls-cert and --tls-key it also makes TLS mutual (callers need a certificate it signed)"
    )
    tls_server_name: str | None = Field(
        None, description="the name the certificates of the services it calls are issued to, when it is not the "
        "host of their address"
    )
    internal_token: str = _internal_token_field()
    insecure: bool = Field(
        False, description="serve plaintext on a --host other machines can reach (refused without it)"
    )
    log_level: str = Field("info", description="debug, info, warning, error")
    device: str = Field("auto", description="auto, cpu, cuda, cuda:N")
    dtype: str = Field(
        "auto",
        description="auto (on CPU a GGUF target computes on its file's quantized blocks, other weights fp32; bf16 on "
        "CUDA), float32, bfloat16, float16",
    )


class TargetSettings(_Base):
    target_model: str = _model_field("target_model", DEFAULT_TARGET, "target model SPEC")
    served_model_name: str | None = Field(None, description="model id (default: from the SPEC)")
    port: int = Field(PORTS["target_grpc"], description="gRPC port")
    metrics_port: int = Field(PORTS["target_metrics"], description="Prometheus port (0 = off)")
    session_ttl_s: float = Field(600.0, description="idle seconds before a session is dropped")
    max_sessions: int = Field(256, description="sessions held at once; more are refused")
    max_context_len: int = Field(0, description="tokens per session (0 = the model's limit)")
    prefill_chunk_tokens: int = Field(
        512,
        ge=0,
        description="prompt tokens per prefill pass; other sessions decode between the chunks of a long prompt "
        "(0 = the whole prompt in one pass)",
    )
    max_batched_tokens: int = Field(
        64,
        ge=1,
        description="most tokens one forward pass takes from the verify blocks and decode steps of sessions waiting "
        "together (1 = one session per pass)",
    )
    kv_cache_memory_gb: float = Field(
        0.0,
        ge=0.0,
        description="memory the sessions' KV caches may take; each session reserves room for its prompt and "
        "max_new_tokens, and sessions past the budget are refused (0 = half the memory free once the model is loaded)",
    )
    screened_head: bool = Field(
        True,
        description="greedy tokens from a bfloat16 copy of the LM head, the few that can win rescored exactly (CPU, "
        "float32 heads of 64 MB or more; the same tokens, half the head's reads; --no-screened-head: the float32 head); "
        "on quantized weights, the head over only the rows a verification can reach, in waves",
    )
    prefix_cache: bool = Field(
        True,
        description="keep ended sessions' KV caches in the budget's free room, so a prompt that starts the same way "
        "(the next turn of a chat) prefills only the rest, as does one that starts as a live session's (a request's "
        "other choices) (--no-prefix-cache: prefill every prompt whole)",
    )


class DraftSettings(_Base):
    dtype: str = Field(
        "auto",
        description="auto (an eagle head steps in bf16; an hf draft loads in fp32 on CPU, bf16 on CUDA), float32, "
        "bfloat16, float16",
    )
    draft_model: str = _model_field("draft_model", DEFAULT_DRAFT, DRAFT_HELP)
    target_model: str = _model_field(
        "target_model",
        DEFAULT_TARGET,
        "the target's SPEC: 'eagle' picks its head and reads its embedding and LM head; its tokenizer guides "
        "constrained sessions' drafts along their grammar",
    )
    target_address: PoolAddresses = Field(
        f"127.0.0.1:{PORTS['target_grpc']}",
        description="the targets this draft serves sessions of: gRPC addresses, comma-separated; a DNS name stands "
        "for every address it resolves to",
    )
    port: int = Field(PORTS["draft_grpc"], description="gRPC port")
    metrics_port: int = Field(PORTS["draft_metrics"], description="Prometheus port (0 = off)")
    num_speculative_tokens: int = Field(DEFAULT_K, ge=1, le=64, description="default K")
    draft_top_k: int = Field(32, ge=1, description="the draft samples from its renormalised top-k")
    eagle_min_confidence: float = Field(
        0.5, ge=0.0, lt=1.0, description="an eagle block ends after a draft the head gives less probability than this"
    )
    eagle_k: int = Field(
        3,
        ge=0,
        le=64,
        description="in ngram+eagle, the most tokens the eagle head drafts in a block where lookup has none "
        "(0 = the block's K); its drafts past the third are accepted too rarely to pay for their steps",
    )
    eagle_overrule_confidence: float = Field(
        0.3,
        ge=0.0,
        le=1.0,
        description="in ngram+eagle, a lookup block copied after a match of a single token gives way to the head "
        "when the head's own next token differs and it gives it at least this probability (0 = never)",
    )
    draft_tree_nodes: int = Field(
        5,
        ge=0,
        le=64,
        description="in ngram+eagle, sessions draft a token tree of at most this many nodes (the head's top "
        "guesses and lookup's copy, best first by estimated path probability) instead of a chain (0 = chains); "
        "greedy and sampled sessions alike, each measured apart with --draft-trees measured",
    )
    draft_tree_top_k: int = Field(
        2, ge=1, le=8, description="in a token tree, the head's most probable guesses each node branches into"
    )
    draft_trees: Literal["measured", "always"] = Field(
        "measured",
        description="with --draft-tree-nodes above 0: draft a token tree or a chain by which commits more tokens per "
        "second of round on this host, measured as the service serves (measured), or a tree wherever one can be "
        "drafted (always)",
    )
    eagle_vocab: int = Field(
        4096,
        ge=0,
        description="an eagle head proposes only the N tokens the target picks most often (0 = the head's whole "
        "reduced vocabulary); fewer rows make each draft step cheaper",
    )
    cut_blocks: bool = Field(
        True,
        description="send each proposal only as far as pays best, from acceptance and pass costs learned from the "
        "verdicts (--no-cut-blocks: whole, up to K)",
    )
    torch_threads: int = Field(
        1,
        ge=0,
        description="CPU threads for the draft's tensor work (0 = torch's default); the default 1 leaves the "
        "cores to the target",
    )
    pipeline_depth: int = Field(
        2, ge=1, le=8,
        description="blocks of a session in flight to the target at once: the next block goes out before the "
        "verdict of the one before it, on the assumption that it is accepted whole, where the measured round trip "
        "to the target says that pays (1 = one block per round trip; docs/pipelining.md)",
    )
    pipeline_hedges: int = Field(
        3, ge=1, le=8,
        description="with --pipeline-depth above 1: blocks sent ahead on one block, each assuming another of its "
        "likely outcomes (accepted whole, or rejected at one of its drafts with the draft's next guess)",
    )
    pipeline_ahead: Literal["measured", "always"] = Field(
        "measured",
        description="with --pipeline-depth above 1: send a block ahead only where the measured round trip to the "
        "target makes it pay for its drafting (measured), or whenever depth and hedges allow (always: draft and "
        "target on separate hardware, where drafting ahead does not slow the target)",
    )
    ngram_max: int = Field(4, ge=1, description="longest n-gram prompt lookup matches")
    ngram_min: int = Field(1, ge=1, description="shortest n-gram prompt lookup matches")


class GatewaySettings(_Base):
    target_model: str = _model_field("target_model", DEFAULT_TARGET, "target SPEC (for its tokenizer)")
    served_model_name: str | None = Field(None, description="model id (default: from the SPEC)")
    target_address: PoolAddresses = Field(
        f"127.0.0.1:{PORTS['target_grpc']}",
        description="target pool: gRPC addresses, comma-separated; a DNS name stands for every address it resolves "
        "to (re-resolved, so the pool can grow and shrink)",
    )
    draft_address: PoolAddresses = Field(
        f"127.0.0.1:{PORTS['draft_grpc']}", description="draft pool: gRPC addresses, as --target-address"
    )
    http_port: int = Field(PORTS["gateway_http"], description="HTTP port (OpenAI API and /metrics)")
    grpc_port: int = Field(PORTS["gateway_grpc"], description="gRPC port (tandem.v1.GatewayService)")
    num_speculative_tokens: int = Field(DEFAULT_K, ge=1, le=64, description="default K")
    # As many as the target holds sessions by default; beyond --fallback-max-sessions they decode
    # autoregressively rather than being refused.
    max_concurrent_requests: int = Field(256, ge=1, description="more get 429 / RESOURCE_EXHAUSTED")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request names none")
    chat_template: str | None = Field(
        None, description="a Jinja chat template, or a file holding one, for chat requests in place of the "
        "tokenizer's own (default: its own; without one, tandem's plain transcript)",
    )
    generation_config: str = Field(
        "auto", pattern="^(auto|none)$",
        description="sampling defaults of requests that leave them out: auto takes temperature, top_p, top_k, min_p "
        "and repetition_penalty from the model's generation_config.json (as vLLM), none OpenAI's (temperature 1)",
    )
    # Stream smoothing (gateway.pacer)
    stream_smoothing: str = Field(
        "auto", pattern="^(off|auto)$", description="pace streamed tokens evenly: auto or off (per request too)"
    )
    stream_smoothing_max_delay_rounds: float = Field(
        2.0, ge=0.0, description="most extra delay a paced token gets, in round times (the first token is never held)"
    )
    draft_probe_tokens: int = Field(
        16, ge=0,
        description="tokens a leg exploring a draft measured slower than another may commit there before the rest "
        "is placed again by measured speed (0: the whole leg; docs/fleet.md#placement)",
    )
    # Session-level fallback to the target's Generate (gateway.policy, gateway.adaptive)
    fallback_adaptive: bool = Field(True, description="fall back mid-session when speculation does not pay")
    fallback_min_acceptance: float = Field(
        0.05, ge=0.0, le=1.0,
        description="fall back below this acceptance (a floor for hopeless drafts: whether speculation pays is "
        "measured in time)",
    )
    fallback_window_rounds: int = Field(8, ge=1, description="rounds the fallback decision looks at")
    fallback_warmup_rounds: int = Field(4, ge=1, description="rounds before the first fallback decision")
    fallback_hysteresis: float = Field(0.1, ge=0.0, description="relative margin to switch back to speculation")
    fallback_prior_tokens: int = Field(
        16, ge=0,
        description="committed tokens' worth of weight the server's measured speculation ratio at the session's "
        "temperature (or break-even, before it has one) adds to a session's own window when judging its speed",
    )
    fallback_reprobe_tokens: int = Field(64, ge=1, description="tokens in fallback before a speculative probe")
    fallback_probe_tokens: int = Field(12, ge=1, description="tokens a speculative probe may commit")
    fallback_max_temperature: float | None = Field(
        None, ge=0.0,
        description="decode autoregressively above this temperature (default: no cut; speculation is judged by what "
        "it measured at each temperature, gateway.prior)",
    )
    fallback_max_sessions: int = Field(
        64, ge=0, description="decode autoregressively beyond this many sessions (0 = never)"
    )
    draft_stall_timeout_s: float = Field(
        5.0,
        gt=0.0,
        description="a draft silent this long is treated as down, unless it keeps serving other sessions or a "
        "prefill holds up the target (then up to 12 times as long)",
    )
    draft_breaker_cooldown_s: float = Field(2.0, ge=0.0, description="seconds an open draft breaker waits to probe")
    draft_breaker_failures: int = Field(3, ge=1, description="failed Speculate calls in a row that open the breaker")
    # Who may use the gateway (gateway.auth)
    api_keys: str = _api_keys_field()
    api_key_file: str | None = Field(None, description="a file of API keys, one per line (# comments)")
    metrics_auth: bool = Field(False, description="require an API key for /metrics too")
    max_concurrent_per_key: int = Field(0, ge=0, description="requests one API key may have in flight (0 = no limit)")
    rate_limit_per_key: float = Field(
        0.0, ge=0.0, description="requests a minute one API key may start, in bursts up to that many (0 = no limit)"
    )
    # Pools and failover (gateway.pool, gateway.target_session)
    target_timeout_s: float = Field(
        10.0, gt=0.0,
        description="a target silent this long that also fails a health check this long is taken out of the pool "
        "and its sessions move to another target",
    )
    failover_wait_s: float = Field(
        60.0, ge=0.0,
        description="how long a session whose target died waits for a serving target (e.g. the same one "
        "restarting) before it fails",
    )
    resolve_interval_s: float = Field(
        10.0, gt=0.0, description="seconds between DNS re-resolutions of the pools' names"
    )
    stream_stall_timeout_s: float = Field(
        30.0, gt=0.0,
        description="a streaming client that reads nothing this long while its response's buffers are full has its "
        "stream cancelled and its sessions released",
    )
    http_tls_cert: str | None = Field(None, description="serve HTTPS with this PEM certificate (chain)")
    http_tls_key: str | None = Field(None, description="the PEM private key of --http-tls-cert")
    grpc_client_certs: bool = Field(
        True, description="with --tls-ca, the gateway's own gRPC port requires client certificates as the internal "
        "hops do (--no-grpc-client-certs: TLS only, clients prove themselves with API keys)"
    )


class ServeSettings(_Base):
    """``tandem serve``: the three services as child processes on one host."""

    target_model: str = _model_field("target_model", DEFAULT_TARGET, "target model SPEC")
    draft_model: str = _model_field("draft_model", DEFAULT_DRAFT, DRAFT_HELP)
    served_model_name: str | None = Field(None, description="model id (default: from the target SPEC)")
    num_speculative_tokens: int = Field(DEFAULT_K, ge=1, le=64, description="default K")
    http_port: int = Field(PORTS["gateway_http"], description="gateway HTTP port (OpenAI API, /metrics)")
    grpc_port: int = Field(PORTS["gateway_grpc"], description="gateway gRPC port")
    draft_port: int = Field(PORTS["draft_grpc"], description="draft gRPC port")
    target_port: int = Field(PORTS["target_grpc"], description="target gRPC port")
    draft_metrics_port: int = Field(PORTS["draft_metrics"], description="draft Prometheus port")
    target_metrics_port: int = Field(PORTS["target_metrics"], description="target Prometheus port")
    ready_timeout_s: float = Field(900.0, description="give up when the stack is not ready by then")
    api_keys: str = _api_keys_field()
    api_key_file: str | None = Field(None, description="a file of API keys, one per line (# comments)")
    metrics_auth: bool = Field(False, description="require an API key for the gateway's /metrics too")
    max_concurrent_per_key: int = Field(0, ge=0, description="requests one API key may have in flight (0 = no limit)")
    rate_limit_per_key: float = Field(0.0, ge=0.0, description="requests a minute one API key may start (0 = no limit)")
    targets: int = Field(1, ge=1, le=16, description="target processes (a local fleet; each its own ports)")
    drafts: int = Field(1, ge=1, le=16, description="draft processes (a local fleet; each its own ports)")
    chat_template: str | None = Field(
        None, description="a Jinja chat template, or a file holding one, for chat requests in place of the "
        "tokenizer's own (default: its own; without one, tandem's plain transcript)",
    )
    stream_smoothing: str = Field("auto", pattern="^(off|auto)$", description="gateway stream smoothing: auto or off")
    generation_config: str = Field(
        "auto", pattern="^(auto|none)$",
        description="sampling defaults of requests that leave them out: auto takes temperature, top_p, top_k, min_p "
        "and repetition_penalty from the model's generation_config.json (as vLLM), none OpenAI's (temperature 1)",
    )
    http_tls_cert: str | None = Field(None, description="the gateway serves HTTPS with this PEM certificate (chain)")
    http_tls_key: str | None = Field(None, description="the PEM private key of --http-tls-cert")

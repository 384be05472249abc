"""OpenTelemetry tracing shared by the three services: set-up from ``OTEL_*``.

One request is one trace. The gateway opens a SERVER span per generation request (named and
attributed after the GenAI semantic conventions), every outgoing gRPC call gets a CLIENT span whose
W3C trace context travels in the call's metadata, and every traced gRPC server opens a SERVER span
that continues the caller's trace::

    gateway  chat gemma-3-270m                  SERVER, gen_ai.* attributes
      ├─ tandem.v1.TargetService/Prefill        CLIENT ─▶ target  .../Prefill SERVER
      ├─ tandem.v1.DraftService/Speculate       CLIENT ─▶ draft   .../Speculate SERVER, round events
      │                                                     └─ .../Verify CLIENT ─▶ target .../Verify SERVER
      └─ tandem.v1.TargetService/Release        CLIENT ─▶ target  .../Release SERVER

When tracing is on
------------------
* ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``: off.
* ``OTEL_TRACES_EXPORTER`` unset: on only when an OTLP endpoint is configured
  (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``). A service nobody
  configured does not try to reach a collector that is not there.
* ``OTEL_TRACES_EXPORTER=otlp`` (explicitly): on, with the SDK's default endpoint
  (``localhost:4317``) when none is given. ``console`` prints spans to stdout (debugging).
* OTLP goes over gRPC (``OTEL_EXPORTER_OTLP_*PROTOCOL`` other than ``grpc`` turns tracing off with
  a warning: no HTTP exporter is installed).

Everything else (headers, TLS, timeouts, batch sizes, sampler, resource attributes) is read by the
OpenTelemetry SDK from its standard variables. ``OTEL_SERVICE_NAME`` names the service; unset, it
is ``tandem-<service>``.

When tracing is off no SDK is set up, servers get no interceptor, clients add no metadata, and the
instrumented code paths cost one boolean test each (:func:`enabled`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

log = logging.getLogger(__name__)

TRACER_NAME = "tandem"


# -- set-up ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TracingDecision:
    """What the environment asks for: the exporters to set up (empty = tracing off) and why."""

    exporters: tuple[str, ...]
    reason: str

    @property
    def enabled(self) -> bool:
        return bool(self.exporters)


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def decide(env: Mapping[str, str] | None = None) -> TracingDecision:
    """Reads the ``OTEL_*`` variables (see the module docstring for the rules)."""
    env = os.environ if env is None else env
    if _truthy(env.get("OTEL_SDK_DISABLED")):
        return TracingDecision((), "OTEL_SDK_DISABLED is set")
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not names:
        if not endpoint:
            return TracingDecision((), "no OTLP endpoint configured")
        names = ["otlp"]
    if "none" in names:
        return TracingDecision((), "OTEL_TRACES_EXPORTER=none")
    chosen: list[str] = []
    for name in names:
        if name == "console":
            chosen.append(name)
        elif name == "otlp":
            protocol = (
                env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
            ).strip().lower()
            if protocol != "grpc":
                log.warning("OTLP protocol %r is not supported (only grpc); the otlp trace exporter is off", protocol)
                continue
            chosen.append(name)
        else:
            log.warning("unknown trace exporter %r in OTEL_TRACES_EXPORTER (supported: otlp, console, none)", name)
    if not chosen:
        return TracingDecision((), f"no supported exporter in OTEL_TRACES_EXPORTER={','.join(names)}")
    return TracingDecision(tuple(chosen), f"exporting to {', '.join(chosen)}")


class _State:
    """The process's tracing: None until :func:`setup_tracing` or :func:`install` turned it on."""

    provider: Any = None
    tracer: trace.Tracer | None = None


_state = _State()


def enabled() -> bool:
    """True when this process records spans; every instrumented path tests this first."""
    return _state.tracer is not None


def tracer() -> trace.Tracer:
    """The installed tracer (only meaningful while :func:`enabled`)."""
    return _state.tracer if _state.tracer is not None else trace.NoOpTracer()


def install(provider: Any) -> None:
    """Makes ``provider`` (an SDK ``TracerProvider``) this process's tracing, without touching
    OpenTelemetry's global provider (tests install an in-memory one and uninstall it)."""
    _state.provider = provider
    _state.tracer = provider.get_tracer(TRACER_NAME)


def uninstall() -> None:
    _state.provider = None
    _state.tracer = None


def setup_tracing(service: str, env: Mapping[str, str] | None = None) -> bool:
    """Sets up the SDK for service ``service`` ("target", "draft", "gateway") when the environment
    asks for it; returns whether tracing is on. Call :func:`shutdown_tracing` before exiting so the
    last spans are exported."""
    decision = decide(env)
    if not decision.enabled:
        log.debug("tracing off: %s", decision.reason)
        return False
    # Imported here: a service that does not trace never loads the SDK.
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    import tandem

    resource = Resource.create({"service.namespace": "tandem", "service.version": tandem.__version__})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: f"tandem-{service}"}))
    provider = TracerProvider(resource=resource)  # sampler from OTEL_TRACES_SAMPLER(_ARG)
    for name in decision.exporters:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        else:
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)
    install(provider)
    log.info("tracing on (%s) as %s", decision.reason, resource.attributes.get(SERVICE_NAME))
    return True


def shutdown_tracing() -> None:
    """Exports what is buffered and stops the exporters (no-op when tracing is off)."""
    provider = _state.provider
    uninstall()
    if provider is not None:
        try:
            provider.shutdown()
        except Exception:  # never let telemetry turn a clean stop into a failure
            log.exception("stopping the trace exporter failed")

"""What the services report about themselves: traces (set-up, gRPC propagation, tandem's own spans),
Prometheus metrics and logs.

The tracing API is re-exported here, so callers write ``telemetry.client_call(...)``;
``tandem.telemetry.metrics`` and ``tandem.telemetry.logs`` are imported by name.
"""

from tandem.telemetry.propagation import (
    ClientCall,
    TracingServerInterceptor,
    client_call,
    context_from_metadata,
    full_method,
    run_in_context,
    server_interceptors,
)
from tandem.telemetry.spans import GenerationSpan, RoundEvents, record_failover, record_mode_switch
from tandem.telemetry.tracing import (
    TRACER_NAME,
    TracingDecision,
    decide,
    enabled,
    install,
    setup_tracing,
    shutdown_tracing,
    tracer,
    uninstall,
)

__all__ = [
    "TRACER_NAME", "ClientCall", "GenerationSpan", "RoundEvents", "TracingDecision", "TracingServerInterceptor",
    "client_call", "context_from_metadata", "decide", "enabled", "full_method", "install", "record_failover", "record_mode_switch",
    "run_in_context", "server_interceptors", "setup_tracing", "shutdown_tracing", "tracer", "uninstall",
]

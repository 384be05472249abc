"""Starting and stopping the draft service: ``run`` for the ``tandem draft`` process,
``start_draft`` for in-process use (tests, embedding).

Start-up order: bind gRPC with health NOT_SERVING, wait until any target of the pool is SERVING
(so drafts and targets may start in any order), read its Info, build the proposer (an eagle head
is checked against the target's Info before its tensors load), refuse a draft whose tokenizer
differs from the target's, warm the proposer up, then report SERVING. The targets of one pool
serve one model, so the first one up stands for all of them (a gateway checks each it uses).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from draft_service.block_length import BlockLengthPolicy
from draft_service.engine import DraftEngine
from draft_service.errors import IncompatibleDraftError, TokenizerMismatchError
from draft_service.guide import GrammarGuide
from draft_service.prediction import with_prediction_prior
from draft_service.proposers import Proposer, make_proposer
from draft_service.server import SERVICE_NAME, DraftServicer
from draft_service.target_client import TargetClient
from draft_service.targets import TargetRouter
from draft_service.types import TargetInfo
from tandem import telemetry
from tandem.config import DEFAULT_K, DraftSettings
from tandem.models import ModelSpecError
from tandem.models.eagle import EagleCheckpointError
from tandem.models.worker import ModelWorker
from tandem.rpc import addresses
from tandem.rpc.endpoints import Health, bind, enable_reflection, make_server
from tandem.rpc.security import PLAINTEXT, HopSecurity, for_service
from tandem.telemetry.logs import setup_logging
from tandem.telemetry.metrics import Metrics, make_metrics, serve_metrics
from tandem.v1 import draft_pb2_grpc

log = logging.getLogger(__name__)

#: Builds the proposer once the target's Info is known (runs on the model thread).
ProposerFactory = Callable[[TargetInfo], Proposer]


@dataclass
class RunningDraft:
    """A started draft service; ``stop()`` shuts it down."""

    port: int
    server: grpc.aio.Server
    engine: DraftEngine
    targets: TargetRouter
    worker: ModelWorker
    health: Health

    async def stop(self, grace_s: float = 2.0) -> None:
        await self.health.not_serving()
        await self.server.stop(grace_s)  # cancels running Speculate calls after the grace period
        await self.engine.aclose()  # lets the releases of cancelled sessions reach the target
        await self.targets.close()
        await asyncio.to_thread(self.worker.shutdown)


def check_tokenizers(proposer: Proposer, target: TargetInfo) -> None:
    """Refuses a draft that would exchange token ids with a target of another tokenizer."""
    draft_fingerprint = proposer.tokenizer_fingerprint
    if draft_fingerprint and draft_fingerprint != target.tokenizer_fingerprint:
        raise TokenizerMismatchError(
            f"draft model {proposer.model_name!r} (tokenizer fingerprint {draft_fingerprint}) and target model "
            f"{target.model_name!r} (tokenizer fingerprint {target.tokenizer_fingerprint or 'none'}) do not share "
            f"a tokenizer; use a draft model built with the target's tokenizer, or the ngram draft"
        )


async def start_draft(
    proposer_factory: ProposerFactory,
    target_address: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    num_speculative_tokens: int = DEFAULT_K,
    metrics: Metrics | None = None,
    target_wait_s: float | None = 60.0,
    cut_blocks: bool = True,
    security: HopSecurity = PLAINTEXT,
    pipeline_depth: int = DraftSettings.model_fields["pipeline_depth"].default,
    pipeline_hedges: int = DraftSettings.model_fields["pipeline_hedges"].default,
    pipeline_ahead: str = DraftSettings.model_fields["pipeline_ahead"].default,
    grammar_tokenizer: str | None = None,
) -> RunningDraft:
    """Starts the service in the running event loop and returns once it is SERVING.

    ``target_address``: the pool, "host:port,..." (DNS names stand for all their addresses).
    Raises ValueError for a malformed list, TokenizerMismatchError, TargetUnavailableError (after
    ``target_wait_s``; None waits forever) or the proposer's loading error, after stopping what it
    had started. ``security``: the TLS and internal token of its own port and of its calls to the targets.
    The pipeline's defaults are ``tandem draft``'s (``DraftSettings``), so a service started here runs
    the loop the command runs. ``grammar_tokenizer``: the SPEC whose tokenizer (the target's) guides
    constrained sessions' drafts along their grammar (draft_service.guide); None: unguided.
    """
    targets = TargetRouter(target_address, connect=functools.partial(TargetClient, security=security))
    server = make_server([*security.interceptors(SERVICE_NAME),
                          *telemetry.server_interceptors([telemetry.full_method(SERVICE_NAME, "Speculate")])])
    servicer = DraftServicer()
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
    health = Health(server, [SERVICE_NAME])
    enable_reflection(server, [SERVICE_NAME])
    bound_port = bind(server, host, port, security.server_credentials())
    await health.not_serving()
    await server.start()
    worker = ModelWorker("draft-model")
    guide = None if grammar_tokenizer is None else GrammarGuide(grammar_tokenizer)
    try:
        if guide is not None:  # its tokenizer loads while the target may still be loading (docs/structured-output.md)
            await asyncio.to_thread(guide.load)
        first = await targets.wait_for_any(target_wait_s)
        log.info("target pool %s: %s is SERVING; checking this draft against it", target_address, first.address)
        target_info = await first.info()
        proposer = await worker.run(proposer_factory, target_info)
        check_tokenizers(proposer, target_info)
        await worker.run(proposer.warm_up)
        if guide is not None:
            guide.attach(target_info)
        engine = DraftEngine(
            proposer,
            targets,
            target_info,
            worker,
            metrics if metrics is not None else make_metrics("draft"),
            default_k=num_speculative_tokens,
            block_lengths=(BlockLengthPolicy(prior=with_prediction_prior(proposer.acceptance_prior)) if cut_blocks
                           else None),
            pipeline_depth=pipeline_depth,
            pipeline_hedges=pipeline_hedges,
            pipeline_ahead=pipeline_ahead,
            guide=guide,
        )
        servicer.attach(engine)
        await health.serving()
    except BaseException:
        await server.stop(None)
        await targets.close()
        worker.shutdown(wait=False)
        raise
    log.info(
        "draft service (%s%s) serving on %s:%d, %s, target %r; target pool: %s (default %s); blocks: %s; %s",
        proposer.kind,
        f" {proposer.model_name}" if proposer.model_name else "",
        host,
        bound_port,
        security.describe(),
        target_info.model_name,
        ", ".join(targets.allowed),
        targets.default,
        proposer.block_shape,
        (f"pipeline: up to {pipeline_depth} blocks in a chain, {pipeline_hedges} hedges, sent ahead "
         + ("always" if pipeline_ahead == "always" else "where the measured round trip to the target pays")
         if pipeline_depth > 1 else "pipeline: off (one block per round trip)"),
    )
    return RunningDraft(bound_port, server, engine, targets, worker, health)


def limit_torch_threads(threads: int) -> None:
    """Caps the draft's intra-op threads (0 leaves torch's default, one per core).

    The draft and the target take turns, but a process's idle OpenMP workers spin for a while
    after each parallel region. With one worker per core in both processes, the draft's spinning
    workers steal cores from the target's verification and the target's from the draft's steps,
    and rounds get slower. A drafting step is a few small products, for which one core is enough
    (figures: docs/drafting.md#draft-threads).
    """
    if threads > 0:
        import torch

        torch.set_num_threads(threads)


def run(settings: DraftSettings) -> None:
    """Runs the draft service until SIGINT or SIGTERM (``tandem draft``). Blocking.

    Waits for the target as long as it takes. A draft that cannot serve this target (tokenizer
    mismatch, an eagle head trained for another target, a SPEC naming no model) exits with
    SystemExit and a one-line reason, not a traceback.
    """
    if not logging.getLogger().handlers:  # ``tandem draft`` has set it up already
        setup_logging("draft", settings.log_level)
    try:
        addresses.parse(settings.target_address, "--target-address")
    except ValueError as exc:
        raise SystemExit(f"tandem draft: {exc}") from exc
    limit_torch_threads(settings.torch_threads)
    telemetry.setup_tracing("draft")
    try:
        asyncio.run(_serve_until_signalled(settings))
    except (TokenizerMismatchError, IncompatibleDraftError, EagleCheckpointError, ModelSpecError) as exc:
        raise SystemExit(f"tandem draft: {exc}") from exc
    finally:
        telemetry.shutdown_tracing()


async def _serve_until_signalled(settings: DraftSettings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    security = for_service(settings, "draft")
    metrics = make_metrics("draft")
    serve_metrics(metrics, settings.host, settings.metrics_port)
    starting = asyncio.create_task(
        start_draft(
            functools.partial(make_proposer, settings),
            settings.target_address,
            host=settings.host,
            port=settings.port,
            num_speculative_tokens=settings.num_speculative_tokens,
            metrics=metrics,
            target_wait_s=None,
            cut_blocks=settings.cut_blocks,
            security=security,
            pipeline_depth=settings.pipeline_depth,
            pipeline_hedges=settings.pipeline_hedges,
            pipeline_ahead=settings.pipeline_ahead,
            grammar_tokenizer=settings.target_model,
        )
    )
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        log.info("stopping before the draft service was ready")
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        return
    stopping.cancel()
    running = starting.result()  # raises what stopped the start-up
    await stop.wait()
    log.info("stopping the draft service")
    await running.stop()

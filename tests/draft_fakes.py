"""Test doubles of the target for the draft-service tests, and the tests that keep them honest.

``ReferenceTarget`` implements the Verify semantics of ``protos/tandem/v1/target.proto`` for greedy
decoding in memory, with a tiny Hugging Face model as the truth (a full forward pass per block, no
KV cache, so it shares no code or shortcut with the draft). ``FakeTargetService`` serves it over
gRPC for in-process round trips, since the real target service is developed separately.
The other ``test_draft_*`` modules import from here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
import pytest
import torch

from draft_service.types import ProposedBlock, FinishReason, Verdict, VerdictStatus
from tandem.rpc.endpoints import Health, bind, make_server
from tandem.models import LoadedModel, load_model, tokenizer_fingerprint
from tandem.v1 import common_pb2, target_pb2, target_pb2_grpc

TARGET_SERVICE = "tandem.v1.TargetService"


def load_tiny(folder) -> LoadedModel:
    return load_model(str(folder), device="cpu", dtype="float32")


@torch.inference_mode()
def greedy_continuation(model, token_ids: Sequence[int], n: int) -> list[int]:
    """n greedy tokens after token_ids, recomputing the whole sequence each step (no cache)."""
    seq = list(token_ids)
    for _ in range(n):
        logits = model(torch.tensor([seq])).logits  # [1, len, vocab]
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(token_ids) :]


def generate_greedy(model, prompt: Sequence[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    """transformers' own greedy ``generate()``, cut after the first EOS (it pads after it)."""
    out = model.generate(
        torch.tensor([list(prompt)]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_token_id,
        pad_token_id=0,
    )
    tokens = out[0, len(prompt) :].tolist()
    if eos_token_id is not None and eos_token_id in tokens:
        tokens = tokens[: tokens.index(eos_token_id) + 1]
    return tokens


@dataclass
class _RefSession:
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    end_ids: frozenset[int]
    finish: FinishReason = FinishReason.NONE


@dataclass
class ReferenceTarget:
    """A target session store with target.proto's greedy Prefill/Verify/Release semantics."""

    model: object
    eos_token_ids: tuple[int, ...] = ()
    max_context_len: int = 0
    sessions: dict[str, _RefSession] = field(default_factory=dict)

    @torch.inference_mode()
    def _greedy(self, seq: Sequence[int], positions: int) -> list[int]:
        """The target's argmax after each of the last ``positions`` prefixes of seq."""
        logits = self.model(torch.tensor([list(seq)])).logits[0]  # [len, vocab]
        return logits[len(seq) - positions :].argmax(-1).tolist()

    def prefill(
        self,
        session_id: str,
        prompt: Sequence[int],
        max_new_tokens: int = 0,
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = (),
    ) -> tuple[int, FinishReason]:
        end_ids = frozenset(stop_token_ids) | (frozenset() if ignore_eos else frozenset(self.eos_token_ids))
        session = _RefSession(list(prompt), len(prompt), max_new_tokens, end_ids)
        self.sessions[session_id] = session
        first = self._greedy(prompt, 1)
        committed = self._commit(session, first)
        return committed[0], session.finish

    def verify(
        self,
        session_id: str,
        base_len: int,
        assumed: Sequence[int],
        draft: Sequence[int],
        parents: Sequence[int] = (),
    ) -> Verdict:
        """Raises KeyError for an unknown session (NOT_FOUND over gRPC). ``parents``: a token
        tree (each draft's parent, -1 for the last committed token), verified path by path."""
        session = self.sessions[session_id]
        now = len(session.tokens)
        if session.finish is not FinishReason.NONE:
            return Verdict(0, VerdictStatus.FINISHED, committed_len=now, finish_reason=session.finish)
        if base_len + len(assumed) != now or session.tokens[base_len:] != list(assumed):
            return Verdict(0, VerdictStatus.STALE, committed_len=now)
        walk = self._walk_tree(session.tokens, draft, parents) if parents else self._walk_chain(session.tokens, draft)
        accepted_ids, next_token = walk
        committed = self._commit(session, [*accepted_ids, next_token])
        accepted = len(accepted_ids)
        return Verdict(
            0,
            VerdictStatus.OK,
            num_accepted=min(accepted, len(committed)),
            committed_token_ids=tuple(committed),
            committed_len=len(session.tokens),
            finish_reason=session.finish,
        )

    def _walk_chain(self, tokens: list[int], draft: Sequence[int]) -> tuple[list[int], int]:
        """The accepted prefix of a chain and the target's next token after it."""
        target = self._greedy(tokens + list(draft), len(draft) + 1)  # [k + 1]
        accepted = 0
        while accepted < len(draft) and draft[accepted] == target[accepted]:
            accepted += 1
        return list(draft[:accepted]), target[accepted]

    def _walk_tree(self, tokens: list[int], draft: Sequence[int], parents: Sequence[int]) -> tuple[list[int], int]:
        """From the root, follow the child equal to the target's choice after the path so far
        (one plain forward per step: slow, and independent of the engine's tree attention)."""
        path: list[int] = []
        node = -1
        while True:
            choice = self._greedy(tokens + path, 1)[0]
            child = next((i for i, p in enumerate(parents) if p == node and draft[i] == choice), None)
            if child is None:
                return path, choice
            path.append(choice)
            node = child

    def release(self, session_id: str) -> bool:
        return self.sessions.pop(session_id, None) is not None

    def _commit(self, session: _RefSession, tokens: list[int]) -> list[int]:
        """Appends tokens up to the first that ends the session (end id, budget, context)."""
        for i, token in enumerate(tokens):
            session.tokens.append(token)
            generated = len(session.tokens) - session.prompt_len
            if token in session.end_ids:
                session.finish = FinishReason.STOP
            elif (session.max_new_tokens and generated >= session.max_new_tokens) or (
                self.max_context_len and len(session.tokens) >= self.max_context_len
            ):
                session.finish = FinishReason.LENGTH
            if session.finish is not FinishReason.NONE:
                return tokens[: i + 1]
        return tokens


class InMemoryVerifier:
    """The loop's BlockVerifier over a ReferenceTarget; records every block it saw."""

    def __init__(self, target: ReferenceTarget) -> None:
        self.target = target
        self.blocks: list[ProposedBlock] = []
        self._answers: list[Verdict] = []  # verdicts of blocks sent and not yet received, oldest first

    async def verify(self, block: ProposedBlock) -> Verdict:
        await self.send(block)
        return await self.receive(block.block_id)

    async def send(self, block: ProposedBlock) -> None:
        """Judged at once, in order (what the target does with a stream's blocks)."""
        self.blocks.append(block)
        proposal = block.proposal
        verdict = self.target.verify(block.session_id, block.base_len, block.assumed_token_ids, proposal.token_ids,
                                     proposal.parents)
        self._answers.append(Verdict(**{**verdict.__dict__, "block_id": block.block_id}))

    async def receive(self, block_id: int) -> Verdict:
        verdict = self._answers.pop(0)
        assert verdict.block_id == block_id, (verdict.block_id, block_id)
        return verdict


_FINISH_TO_WIRE = {
    FinishReason.NONE: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
}
_STATUS_TO_WIRE = {
    VerdictStatus.OK: target_pb2.VERDICT_STATUS_OK,
    VerdictStatus.STALE: target_pb2.VERDICT_STATUS_STALE,
    VerdictStatus.FINISHED: target_pb2.VERDICT_STATUS_FINISHED,
}


class FakeTargetService(target_pb2_grpc.TargetServiceServicer):
    """TargetService over a ReferenceTarget, recording what the draft sends."""

    def __init__(self, target: ReferenceTarget, model_name: str, fingerprint: str, vocab_size: int) -> None:
        self.target = target
        self.model_name = model_name
        self.fingerprint = fingerprint
        self.vocab_size = vocab_size
        self.requests: list[target_pb2.VerifyRequest] = []
        self.released: list[str] = []
        self.verify_delay_s = 0.0
        self.streams_opened = 0
        self.streams_open = 0  # Verify handlers still running

    async def Info(self, request, context):
        return target_pb2.TargetServiceInfoResponse(
            model_name=self.model_name,
            vocab_size=self.vocab_size,
            tokenizer_fingerprint=self.fingerprint,
            max_context_len=self.target.max_context_len,
            eos_token_ids=self.target.eos_token_ids,
        )

    async def Verify(self, request_iterator, context) -> AsyncIterator[target_pb2.VerifyResponse]:
        self.streams_opened += 1
        self.streams_open += 1
        try:
            async for request in request_iterator:
                self.requests.append(request)
                if self.verify_delay_s:
                    await asyncio.sleep(self.verify_delay_s)
                try:
                    verdict = self.target.verify(
                        request.session_id, request.base_len, request.assumed_token_ids, request.draft_token_ids,
                        request.draft_parents,
                    )
                except KeyError:
                    await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown session {request.session_id!r}")
                yield target_pb2.VerifyResponse(
                    block_id=request.block_id,
                    status=_STATUS_TO_WIRE[verdict.status],
                    num_accepted=verdict.num_accepted,
                    committed_token_ids=verdict.committed_token_ids,
                    committed_len=verdict.committed_len,
                    finish_reason=_FINISH_TO_WIRE[verdict.finish_reason],
                )
        finally:
            # However the stream ends: the caller half-closes it, cancels it (CancelledError inside
            # the handler, GeneratorExit at a yield), or its session was released under a block in
            # flight (NOT_FOUND).
            self.streams_open -= 1

    async def Release(self, request, context):
        self.released.append(request.session_id)
        return target_pb2.ReleaseResponse(released=self.target.release(request.session_id))


@dataclass
class FakeTarget:
    service: FakeTargetService
    server: grpc.aio.Server
    health: Health
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


async def start_fake_target(
    loaded: LoadedModel,
    *,
    serving: bool = True,
    fingerprint: str | None = None,
    max_context_len: int = 0,
    service_class: type[FakeTargetService] = FakeTargetService,
) -> FakeTarget:
    """A FakeTargetService (or ``service_class``, a subclass) on a free loopback port, with gRPC health."""
    reference = ReferenceTarget(loaded.model, (loaded.tokenizer.eos_token_id,), max_context_len)
    if fingerprint is None:
        fingerprint = tokenizer_fingerprint(loaded.tokenizer)
    service = service_class(reference, loaded.name, fingerprint, loaded.model.config.vocab_size)
    server = make_server()
    target_pb2_grpc.add_TargetServiceServicer_to_server(service, server)
    health = Health(server, [TARGET_SERVICE])
    port = bind(server, "127.0.0.1", 0)
    await server.start()
    await (health.serving() if serving else health.not_serving())
    return FakeTarget(service, server, health, port)

"""The head drafts with the target's penalties and bias (``draft_service.proposers.shaping``): its
logits are reshaped as the target's are (against the target's own code, over the head's reduced
vocabulary), a banned token is never drafted, the Speculate request carries the shaping, and
speculation stays exact."""

from __future__ import annotations

import torch
from draft_fakes import generate_greedy
from test_draft_eagle import PROMPT, EngineVerifier, load_eagle, run_inline
from test_target_grammar import decode

from draft_service import wire
from draft_service.loop import SpeculationLoop
from draft_service.proposers.hf import HfProposer
from draft_service.proposers.ngram import NgramProposer
from draft_service.proposers.ngram_first import NgramFirstProposer
from draft_service.proposers.shaping import ShapedLogits
from draft_service.types import LogitShaping, SamplingParams, SessionSpec
from target_service.engine import TargetEngine
from target_service.logit_bias import LogitBias
from target_service.penalties import Penalties
from target_service.session import SessionConfig
from tandem.v1 import common_pb2, draft_pb2


def test_the_heads_logits_are_shaped_as_the_targets_over_its_reduced_vocabulary() -> None:
    vocab = 40
    vocab_ids = torch.tensor([3, 9, 1, 20, 33, 5, 12, 7])  # [reduced] the head scores these target ids
    tokens = [1, 3, 3, 8, 30, 9, 9, 9, 5, 1]  # the prompt's 4, then 6 generated
    shaping = LogitShaping(presence=0.5, frequency=0.75, repetition=1.4, bias=((7, -100.0), (20, 2.5), (39, 9.0)),
                           generated_from=4)
    shaped = ShapedLogits(shaping, vocab_ids)
    shaped.commit(tokens)
    logits = torch.randn(3, vocab)  # [rows, vocab]
    target = Penalties(0.5, 0.75, vocab, "cpu", generated=tokens[4:], repetition=1.4, prompt=tokens)
    expected = target.applied(LogitBias(shaping.bias, "cpu").applied(logits))[:, vocab_ids]  # [rows, reduced]
    assert torch.allclose(shaped.apply(logits[:, vocab_ids]), expected)
    # Committing again recounts: the same as a fresh session on the longer sequence.
    shaped.commit([*tokens, 12, 12])
    fresh = ShapedLogits(shaping, vocab_ids)
    fresh.commit([*tokens, 12, 12])
    assert torch.equal(shaped.apply(logits[:, vocab_ids]), fresh.apply(logits[:, vocab_ids]))


def test_a_speculate_request_carries_the_targets_shaping() -> None:
    def spec(**params):
        request = draft_pb2.SpeculateRequest(session_id="s", token_ids=[1, 2, 3, 4], prompt_len=4,
                                             params=common_pb2.SessionParams(max_new_tokens=8, **params))
        return wire.spec_from_request(request, 4)

    assert spec().shaping is None and spec(repetition_penalty=1.0).shaping is None
    shaping = spec(frequency_penalty=0.5, repetition_penalty=1.25, logit_bias={9: -100.0, 2: 1.0},
                   continued_tokens=2).shaping
    assert shaping == LogitShaping(0.0, 0.5, 1.25, ((2, 1.0), (9, -100.0)), generated_from=2)


def test_a_banned_token_is_never_drafted_and_the_answer_is_the_same(llama, head) -> None:
    eagle = load_eagle(head, llama)
    hidden = torch.randn(1, llama.model.config.hidden_size)  # [1, hidden]
    plain = eagle.new_session(PROMPT[:-1], SamplingParams())
    plain.commit(len(PROMPT) - 1, PROMPT[-1:], hidden)
    drafts = plain.propose(4).token_ids
    banned = LogitShaping(bias=tuple((t, -100.0) for t in sorted(set(drafts))))
    session = eagle.new_session(PROMPT[:-1], SamplingParams(), banned)
    session.commit(len(PROMPT) - 1, PROMPT[-1:], hidden)
    assert session.propose(4).token_ids and not set(session.propose(4).token_ids) & set(drafts)


N, BANNED = 24, PROMPT[1]
# A repetition penalty, a frequency penalty and a banned token: the target's session and the draft's shaping.
PENALISED = SessionConfig(max_new_tokens=N, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.4,
                          logit_bias=((BANNED, -100.0),))
SHAPING = LogitShaping(frequency=0.4, repetition=1.3, bias=((BANNED, -100.0),), generated_from=len(PROMPT))


async def speculate_penalised(llama, proposer, shaping: LogitShaping | None, want_hidden_states: bool = False):
    """The loop of a fresh session against the in-process target under ``PENALISED``, drafted by
    ``proposer`` with ``shaping``: (the session's tokens, its rounds)."""
    engine = TargetEngine(llama)
    first = engine.prefill("s", PROMPT, PENALISED)
    committed = (*PROMPT, first.token_id)
    spec = SessionSpec("s", committed, len(PROMPT), SamplingParams(), 3, session_max_new_tokens=N, shaping=shaping)
    loop = SpeculationLoop(spec, proposer.new_session(committed, SamplingParams(), shaping), EngineVerifier(engine),
                           run_inline, want_hidden_states=want_hidden_states)
    rounds = [r async for r in loop.rounds()]
    return [first.token_id, *(t for r in rounds for t in r.token_ids)], rounds


async def test_penalised_speculation_equals_the_targets_penalised_decoding(llama, head) -> None:
    """The loop against the in-process target with a repetition penalty, a frequency penalty and a
    bias, drafted with the same shaping: the target's own penalised greedy answer, token for token."""
    expected = decode(TargetEngine(llama), PROMPT, PENALISED, "ar")
    proposer = NgramFirstProposer(NgramProposer(), load_eagle(head, llama), overrule_confidence=0.3)
    tokens, _ = await speculate_penalised(llama, proposer, SHAPING, want_hidden_states=True)
    assert tokens == expected and BANNED not in tokens
    assert tokens != generate_greedy(llama.model, PROMPT, N, None)


async def test_a_model_draft_drafts_with_the_shaping_and_the_answer_is_the_targets(llama) -> None:
    """A transformers draft (``hf``; here the target's own model) shapes its logits as the target
    does: with the shaping its greedy drafts are the target's penalised answer and nearly all are
    accepted; without it, far fewer. The answer is the target's either way, and a banned token is
    never drafted."""
    expected = decode(TargetEngine(llama), PROMPT, PENALISED, "ar")
    proposer = HfProposer(llama)
    accepted = {}
    for shaping in (SHAPING, None):
        tokens, rounds = await speculate_penalised(llama, proposer, shaping)
        assert tokens == expected
        accepted[shaping is not None] = sum(r.num_accepted for r in rounds) / sum(r.num_draft_tokens for r in rounds)
    assert BANNED not in proposer.new_session((*PROMPT, *expected), SamplingParams(), SHAPING).propose(4).token_ids
    assert accepted[True] > 0.8 and accepted[True] > accepted[False] + 0.2, accepted

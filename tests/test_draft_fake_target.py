"""The draft tests' in-memory reference target is itself checked against transformers."""

from __future__ import annotations

import pytest
from draft_fakes import ReferenceTarget, generate_greedy, greedy_continuation, load_tiny

from draft_service.types import FinishReason, VerdictStatus
from tandem.models import LoadedModel


@pytest.fixture(scope="module")
def target(tiny_dir) -> LoadedModel:
    return load_tiny(tiny_dir)


PROMPT = (2, 40, 41, 42, 43, 44, 45)


def test_reference_target_reproduces_generate(target):
    """Blocks of any correctness give transformers' greedy generate(), so the double is a valid truth."""
    eos = target.tokenizer.eos_token_id
    expected = generate_greedy(target.model, PROMPT, 24, eos)
    reference = ReferenceTarget(target.model, (eos,))
    first, _ = reference.prefill("s", PROMPT, max_new_tokens=24)
    out = [first]
    drafts = [(), (7, 8), tuple(expected[1:4]), (expected[4], 9), tuple(expected[6:10])]
    for draft in drafts * 10:
        base = len(PROMPT) + len(out)
        verdict = reference.verify("s", base, (), draft)
        if verdict.status is VerdictStatus.FINISHED:
            break
        assert verdict.committed_len == base + len(verdict.committed_token_ids)
        out.extend(verdict.committed_token_ids)
    assert out == expected


def test_reference_target_refuses_stale_blocks_without_change(target):
    reference = ReferenceTarget(target.model)
    reference.prefill("s", PROMPT)
    before = list(reference.sessions["s"].tokens)
    stale_base = reference.verify("s", len(before) - 1, (), (5,))
    stale_assumed = reference.verify("s", len(before) - 1, (before[-1] + 1,), (5,))
    assert stale_base.status is stale_assumed.status is VerdictStatus.STALE
    assert stale_base.committed_len == len(before)
    assert reference.sessions["s"].tokens == before
    pipelined = reference.verify("s", len(before) - 1, (before[-1],), ())
    assert pipelined.status is VerdictStatus.OK and len(pipelined.committed_token_ids) == 1


def test_reference_target_finishes_on_budget_and_stop_ids(target):
    expected = greedy_continuation(target.model, PROMPT, 6)
    reference = ReferenceTarget(target.model)
    reference.prefill("len", PROMPT, max_new_tokens=3)
    verdict = reference.verify("len", len(PROMPT) + 1, (), tuple(expected[1:6]))
    assert verdict.committed_token_ids == tuple(expected[1:3]) and verdict.finish_reason is FinishReason.LENGTH
    assert reference.verify("len", verdict.committed_len, (), ()).status is VerdictStatus.FINISHED
    reference.prefill("stop", PROMPT, stop_token_ids=[expected[2]])
    verdict = reference.verify("stop", len(PROMPT) + 1, (), tuple(expected[1:6]))
    assert verdict.committed_token_ids[-1] == expected[2] and verdict.finish_reason is FinishReason.STOP

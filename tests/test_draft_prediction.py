"""Drafting from a predicted output (draft_service.prediction): copies while the output follows the
prediction, the inner drafter where it does not, copying again once the output's last tokens are
found in it; and the counts of copied drafts a verdict accepted."""

from __future__ import annotations

from collections.abc import Sequence

from draft_service.loop import prediction_counts
from draft_service.prediction import PredictedSession, is_predicted
from draft_service.proposers.base import ProposerSession
from draft_service.types import Proposal

PROMPT = [900, 901, 902]
PREDICTION = list(range(10, 40))  # 30 tokens


class Inner(ProposerSession):
    """A drafter that always proposes 7s (as ``source``), and records what it was told."""

    def __init__(self, source: str = "head:0.5") -> None:
        self.commits: list[tuple[int, tuple[int, ...]]] = []
        self.source = source
        self.proposed = 0

    def propose(self, max_tokens: int) -> Proposal:
        self.proposed += 1
        return Proposal((7,) * max_tokens, sources=(self.source,) * max_tokens)

    def commit(self, base_len: int, token_ids: Sequence[int], hidden_states=None) -> None:
        self.commits.append((base_len, tuple(token_ids)))

    def close(self) -> None:
        pass


def session(output: Sequence[int] = ()) -> tuple[PredictedSession, Inner]:
    inner = Inner()
    return PredictedSession(inner, PREDICTION, len(PROMPT), [*PROMPT, *output]), inner


def test_copies_while_the_output_follows_the_prediction() -> None:
    predicted, inner = session()
    first = predicted.propose(4)
    assert first.token_ids == (10, 11, 12, 13) and first.sources == ("prediction:0",) * 4
    predicted.commit(len(PROMPT), [10, 11, 12])  # three accepted, the target's own token was 12
    second = predicted.propose(5)
    assert second.token_ids == (13, 14, 15, 16, 17) and all(is_predicted(s) for s in second.sources)
    assert second.sources[0] == "prediction:3" and inner.commits == [(len(PROMPT), (10, 11, 12))]
    assert predicted.next_tokens(2) == (13, 14)
    predicted.commit(len(PROMPT) + 3, list(range(13, 40)))  # the whole prediction: nothing left to copy
    assert predicted.propose(3).token_ids == (7, 7, 7)


def test_an_edit_hands_over_to_the_inner_drafter_until_the_output_meets_the_prediction_again() -> None:
    predicted, _ = session(output=[10, 11, 12])
    predicted.commit(len(PROMPT) + 3, [99, 98])  # the output leaves the prediction (an edit)
    assert predicted.propose(3).token_ids == (7, 7, 7)
    predicted.commit(len(PROMPT) + 5, [20, 21])  # back in the prediction, further on
    again = predicted.propose(3)
    assert again.token_ids == (22, 23, 24) and again.sources == ("prediction:2",) * 3
    predicted.commit(len(PROMPT) + 7, [22, 23])
    assert predicted.propose(2).sources == ("prediction:4",) * 2


def test_a_realignment_moves_on_through_the_prediction_and_a_rollback_realigns() -> None:
    repeated = [10, 11, 12, 50, 51, 10, 11, 12, 60, 61]
    predicted = PredictedSession(Inner(), repeated, 1, [0, 10, 11, 12, 50, 51, 9, 10, 11, 12])
    # The output has followed the prediction to index 5; "9 10 11 12" is not in it, "10 11 12" is, at
    # 0 and at 5: the copy resumes past where the output had reached, not at the first occurrence.
    assert predicted.propose(2).token_ids == (60, 61)
    predicted.commit(3, [12, 50])  # rolled back to the output [10, 11] + the new [12, 50]
    assert predicted.propose(2).token_ids == (51, 10)  # "10 11 12 50" occurs once, behind the furthest point


def test_prompt_lookup_copying_after_as_long_a_run_is_taken_instead() -> None:
    """The prediction is often in the prompt as well, where lookup finds it too: the longer
    agreeing run wins, lookup on a tie."""
    for source, expected in (("lookup:4", (7, 7)), ("lookup:2", (13, 14)), ("head:0.9", (13, 14))):
        predicted = PredictedSession(Inner(source), PREDICTION, len(PROMPT), [*PROMPT, 10, 11, 12])
        assert predicted.propose(2).token_ids == expected, source  # (the prediction's run: 3)
    inner = Inner("lookup:16")
    long_run = PredictedSession(inner, PREDICTION, len(PROMPT), [*PROMPT, *PREDICTION[:20]])
    assert long_run.propose(2).token_ids == (30, 31) and inner.proposed == 0  # no longer run to find: not asked


def test_counts_of_copied_drafts_on_the_accepted_path() -> None:
    chain = Proposal((10, 11, 12, 7), sources=("prediction:0", "prediction:0", "prediction:0", "lookup:1"))
    assert prediction_counts(chain, [10, 11, 5], 2) == (3, 2)
    assert prediction_counts(Proposal((7, 7), sources=("lookup:1",) * 2), [7], 1) == (0, 0)
    tree = Proposal((10, 20, 11), sources=("sampled/prediction:4", "head:0.7", "sampled/prediction:4"),
                    parents=(-1, -1, 0))
    assert prediction_counts(tree, [10, 11, 3], 2) == (2, 2)
    assert prediction_counts(tree, [20, 3], 1) == (2, 0)


def test_a_prediction_outside_the_vocabulary_or_too_long_is_refused() -> None:
    import pytest

    from draft_service.errors import InvalidRequestError
    from draft_service.types import SamplingParams, SessionSpec, TargetInfo
    from draft_service.validation import validate_spec
    from tandem.rpc.types import MAX_PREDICTION_TOKENS

    target = TargetInfo("t", vocab_size=1000, tokenizer_fingerprint="")
    spec = SessionSpec("s", tuple(PROMPT[:1]) + (5,), 1, SamplingParams(), 4, prediction_token_ids=(1, 2))
    validate_spec(spec, target)
    for bad, message in (((1, 1000), "outside the target vocabulary"), ((-1,), "outside"),
                         ((1,) * (MAX_PREDICTION_TOKENS + 1), "more than")):
        with pytest.raises(InvalidRequestError, match=message):
            validate_spec(SessionSpec("s", (5, 6), 1, SamplingParams(), 4, prediction_token_ids=bad), target)

"""The prompt-lookup proposer: which n-gram it matches, what it copies, and how it follows commits."""

from __future__ import annotations

import numpy as np
import pytest

from draft_service.proposers.ngram import NgramProposer, find_continuation, find_match
from draft_service.types import SamplingParams

GREEDY = SamplingParams()


def lookup(tokens, ngram_max=4, ngram_min=1):
    return find_continuation(np.asarray(tokens, dtype=np.int64), ngram_max, ngram_min)


def test_longest_suffix_wins_over_a_more_recent_shorter_match():
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 5, 3, 8, 1, 2, 3]
    # "1 2 3" recurs at 0 (continuation at 3); "3" alone recurs more recently at 5.
    assert lookup(tokens) == 3
    assert lookup(tokens, ngram_max=1) == 6


def test_most_recent_occurrence_of_the_same_ngram_wins():
    tokens = [7, 8, 1, 7, 8, 2, 7, 8]
    assert lookup(tokens, ngram_max=2) == 5


def test_no_recurring_suffix_finds_nothing():
    assert lookup([1, 2, 3, 4, 5]) is None
    assert lookup([4]) is None
    # With ngram_min 2, a single recurring token is not enough.
    assert lookup([1, 5, 2, 5], ngram_min=2) is None
    assert lookup([1, 5, 2, 5], ngram_min=1) == 2


def test_the_match_length_comes_with_the_lookup():
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 5, 3, 8, 1, 2, 3]
    assert find_match(np.asarray(tokens, dtype=np.int64), 4, 1) == (3, 3)
    assert find_match(np.asarray([4, 7, 6, 7], dtype=np.int64), 4, 1) == (2, 1)
    assert find_match(np.asarray([1, 2, 3], dtype=np.int64), 4, 1) is None
    session = NgramProposer().new_session([4, 7, 6, 7], GREEDY)
    assert session.lookup(3) == (session.propose(3), 1)
    assert session.lookup(3)[0].token_ids == (6, 7, 6)  # the copied span repeats past the end
    assert session.lookup(0)[1] == 0
    session = NgramProposer().new_session([1, 2, 3], GREEDY)
    assert session.lookup(3)[0].token_ids == () and session.lookup(3)[1] == 0


def _brute_force_match(tokens: list[int], ngram_max: int, ngram_min: int) -> tuple[int, int] | None:
    """The definition, spelled out: the longest recurring suffix, then its latest earlier start."""
    seq = len(tokens)
    for n in range(min(ngram_max, seq - 1), ngram_min - 1, -1):
        starts = [i for i in range(seq - n) if tokens[i : i + n] == tokens[seq - n :]]
        if starts:
            return starts[-1] + n, n
    return None


def test_the_match_is_the_definitions_on_random_sequences():
    """Short alphabets make overlapping and repeated matches common."""
    rng = np.random.default_rng(0)
    for _ in range(3000):
        tokens = rng.integers(0, int(rng.integers(1, 5)), int(rng.integers(1, 40))).tolist()
        for ngram_max, ngram_min in ((4, 1), (3, 2), (1, 1), (6, 3)):
            want = _brute_force_match(tokens, ngram_max, ngram_min)
            assert find_match(np.asarray(tokens, dtype=np.int64), ngram_max, ngram_min) == want, tokens


def test_proposes_what_followed_capped_at_k():
    session = NgramProposer().new_session([10, 11, 12, 13, 14, 10, 11], GREEDY)
    assert session.propose(2).token_ids == (12, 13)
    assert session.propose(0).token_ids == ()


def test_a_copy_reaching_the_end_continues_with_its_own_proposal():
    # The match "10 11" at 0 is followed by 12 13 14 10 11 and then by what is being proposed.
    session = NgramProposer().new_session([10, 11, 12, 13, 14, 10, 11], GREEDY)
    assert session.propose(8).token_ids == (12, 13, 14, 10, 11, 12, 13, 14)
    periodic = NgramProposer().new_session([5, 6, 5, 6, 5, 6], GREEDY)
    assert periodic.propose(5).token_ids == (5, 6, 5, 6, 5)


def test_no_match_proposes_an_empty_block():
    proposal = NgramProposer().new_session([1, 2, 3], GREEDY).propose(5)
    assert proposal.token_ids == () and proposal.probs == ()


def test_commit_rolls_back_unaccepted_drafts_and_appends_the_verdict():
    session = NgramProposer(ngram_max=2).new_session([1, 2, 3, 4, 1, 2], GREEDY)
    assert session.propose(3).token_ids == (3, 4, 1)
    # The target accepted "3" and corrected the next token to 7: the sequence is now ... 1 2 3 7.
    session.commit(6, [3, 7])
    assert session.propose(3).token_ids == ()
    session.commit(8, [1, 2])  # ... 3 7 1 2: "1 2" recurs, most recently at 4 (followed by 3 7)
    assert session.propose(2).token_ids == (3, 7)
    # A rollback below the current length forgets the tail.
    session.commit(3, [4])  # 1 2 3 4
    assert session.propose(2).token_ids == ()
    with pytest.raises(ValueError):
        session.commit(5, [1])


def test_sampling_sessions_stay_deterministic_without_q():
    sampling = SamplingParams(temperature=1.0, seed=3)
    proposal = NgramProposer().new_session([1, 2, 1], sampling).propose(3)
    assert proposal.token_ids == (2, 1, 2) and proposal.probs == ()


def test_invalid_ngram_bounds_are_refused():
    with pytest.raises(ValueError):
        NgramProposer(ngram_max=2, ngram_min=3)
    with pytest.raises(ValueError):
        NgramProposer(ngram_max=2, ngram_min=0)


def test_proposer_describes_itself_as_model_free():
    proposer = NgramProposer()
    assert proposer.kind == "ngram" and proposer.model_name == "" and proposer.tokenizer_fingerprint == ""
    proposer.warm_up()

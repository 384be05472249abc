"""Which tokens the target takes from a pass's scores: the one token after a prompt or a decode
step, the accepted drafts and next token of a chain block, the accepted path of a tree block.

The verifier switch: a step scored through the screened head has only each row's argmax, and is
accepted greedily here (:func:`greedy_chain`, ``tree.greedy_path``); a step with logits goes
through the verifier's kernels (``target_service.verifier``), which handle greedy and sampled rows
alike. Both give the same tokens for a greedy session.

Invariant: every token taken is distributed as the target's own choice after the tokens before
it (speculative sampling for chains; for trees, the target's own choice at each row walked), and
a session's randomness is drawn from its own generator only, in the same order for the same call
(and the same walk), so a seeded session repeats itself whatever else shares its passes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.reference import draw_uniforms, is_greedy
from target_service import tree
from target_service.types import DraftBlock
from target_service.runner import RowScores
from target_service.session import Session
from target_service.verifier import Verifier


def sample(verifier: Verifier, session: Session, scores: RowScores, vocab_size: int, device: str) -> int:
    """One token from the target distribution at the last scored row."""
    if scores.argmax is not None:
        return int(scores.argmax[-1])
    return _sample_row(verifier, session, scores.logits[-1:], vocab_size, device)


def _sample_row(verifier: Verifier, session: Session, logits: torch.Tensor, vocab_size: int, device: str) -> int:
    """A token drawn from the target distribution of one row's ``logits`` [1, vocab]."""
    _, draws = randomness(verifier, session, 0, vocab_size, device)  # no acceptance tests; the token's draw
    s = session.sampling
    return int(verifier.sample_tokens(logits, s.temperature, s.top_p, s.top_k, draws)[0])


def accept_chain(
    verifier: Verifier,
    session: Session,
    block: DraftBlock,
    drafts: list[int],
    scores: RowScores,
    vocab_size: int,
    device: str,
) -> tuple[int, int]:
    """(accepted drafts, the recovered or bonus token) for a chain of k ``drafts`` from the scores
    of its k+1 rows: row i scores the token after ``[last committed, *drafts][i]``."""
    if scores.argmax is not None:
        return greedy_chain(drafts, scores.argmax.tolist())
    k = len(drafts)
    q_ids, q_probs = proposal(block, k, device)  # [1, k, m] x2
    uniforms, draws = randomness(verifier, session, k, vocab_size, device)  # [1, k], the token's draw
    num_accepted, next_token = verifier.verify_chain(
        scores.logits[None],  # [1, k+1, vocab]
        torch.tensor([drafts], dtype=torch.long, device=device).reshape(1, k),  # [1, k]
        q_ids,
        q_probs,
        session.sampling.temperature,
        session.sampling.top_p,
        session.sampling.top_k,
        uniforms,
        draws,
    )
    return int(num_accepted[0]), int(next_token[0])


def accept_tree(
    verifier: Verifier,
    session: Session,
    drafts: Sequence[int],
    parents: Sequence[int],
    scores: RowScores,
    vocab_size: int,
    device: str,
) -> tuple[list[int], int]:
    """(the accepted drafts' indices, root first, and the next token) for a token tree from the
    scores of its 1 + n rows ``[root, *drafts]``: row i + 1 scores the token after draft i's path.

    Greedy: each row's argmax. Sampling: a token drawn from the target's distribution at each row
    the walk reaches, one draw per row from the session's generator (``tree.walk``), so only the
    rows on the accepted path (1 + its length) pay for a softmax over the vocabulary."""
    if scores.argmax is not None:
        return tree.greedy_path(drafts, parents, scores.argmax.tolist())
    if bool(is_greedy(session.sampling.temperature)[0]):
        return tree.greedy_path(drafts, parents, scores.logits.argmax(dim=-1).tolist())

    def draw(row: int) -> int:
        return _sample_row(verifier, session, scores.logits[row : row + 1], vocab_size, device)

    return tree.walk(drafts, parents, draw)


def greedy_chain(drafts: Sequence[int], targets: Sequence[int]) -> tuple[int, int]:
    """Greedy verification from the target's choices (``targets``: k+1 tokens, row i's argmax):
    drafts are accepted while they equal the target's choice; the next token is the target's
    choice after the last accepted one (the recovered token, or the bonus after a full block).
    What ``verify_chain`` does for a greedy row, without its logits."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return accepted, int(targets[accepted])


def randomness(
    verifier: Verifier, session: Session, k: int, vocab_size: int, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms [1, k] and the next token's draw (the verifier's ``token_draws``: [1, vocab]
    exponentials or [1, 1] uniforms) from the session's generator, in that order.

    Greedy sessions use no randomness; they get ones (valid inputs that are ignored).
    """
    if bool(is_greedy(session.sampling.temperature)[0]):
        ones = torch.ones(1, k + vocab_size, device=device)
        return ones[:, :k], ones[:, k:]
    return draw_uniforms((1, k), session.generator), verifier.token_draws(1, vocab_size, session.generator)


def proposal(block: DraftBlock, k: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's q for the first k draft tokens as padded ``q_ids``/``q_probs`` [1, k, m]."""
    if not block.draft_probs:  # a deterministic drafter: q is one-hot on each draft token
        ids = torch.tensor(block.draft_token_ids[:k], dtype=torch.long, device=device).reshape(1, k, 1)
        return ids, torch.ones(1, k, 1, device=device)
    rows = block.draft_probs[:k]
    m = max((len(q.token_ids) for q in rows), default=1)
    ids = torch.zeros(1, k, m, dtype=torch.long)  # [1, k, m]; padding has probability 0
    probs = torch.zeros(1, k, m, dtype=torch.float64)  # [1, k, m]
    for j, q in enumerate(rows):
        ids[0, j, : len(q.token_ids)] = torch.tensor(q.token_ids, dtype=torch.long)
        probs[0, j, : len(q.probs)] = torch.tensor(q.probs, dtype=torch.float64)
    # Validation allows a small rounding error in the sums; the verifier wants q exactly normalised.
    probs = probs / probs.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    return ids.to(device), probs.float().to(device)

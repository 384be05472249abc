"""Many sessions through one TargetEngine at once, each step of theirs one batched pass.

``TargetEngine.run_batch`` answers each call as that call alone would be answered (its sessions do
not interact; only their rows share the weight reads), so sessions run together stay independent:
a statistical test runs its hundreds of seeded sessions this way, on the serving path under load,
in a fraction of the time they take one after another.
"""

from __future__ import annotations

from collections.abc import Callable

from target_service.engine import TargetEngine
from target_service.planner import DecodeStep
from target_service.session import SessionConfig
from target_service.types import DraftBlock, FinishReason, Verdict, VerdictStatus

# A session's next call, given its id, its tokens so far and the number of this call (1, 2, ...).
NextCall = Callable[[str, list[int], int], DecodeStep | DraftBlock]


def decode_step(session_id: str, tokens: list[int], call: int) -> DecodeStep:
    """The next call of a session decoding autoregressively."""
    return DecodeStep(session_id)


def run_together(engine: TargetEngine, prompt: list[int], configs: list[SessionConfig], next_call: NextCall,
                 batch: int = 50, names: list[str] | None = None) -> list[list[int]]:
    """One session per config (named by ``names``), ``batch`` at a time: all prefilled in one pass,
    then each round one pass of every open session's ``next_call`` (a decode step or a draft block),
    until each finishes (its finish reason, or a FINISHED verdict). Each session's generated tokens."""
    names = names or [f"t{i}" for i in range(len(configs))]
    out: list[list[int]] = []
    for start in range(0, len(configs), batch):
        ids = names[start : start + batch]
        firsts = engine.run_batch([engine.begin_prefill(sid, prompt, config)
                                   for sid, config in zip(ids, configs[start : start + batch])])
        tokens = {sid: [unwrap(first).token_id] for sid, first in zip(ids, firsts)}
        calls = dict.fromkeys(ids, 0)
        open_ids = list(ids)
        while open_ids:
            for sid in open_ids:
                calls[sid] += 1
            answers = engine.run_batch([next_call(sid, tokens[sid], calls[sid]) for sid in open_ids])
            for sid, answer in zip(list(open_ids), answers):
                answer = unwrap(answer)
                if isinstance(answer, Verdict):
                    assert answer.status in (VerdictStatus.OK, VerdictStatus.FINISHED), answer
                    tokens[sid] += answer.committed_token_ids
                    ended = answer.status is VerdictStatus.FINISHED or answer.finish_reason is not FinishReason.NONE
                else:
                    tokens[sid] += answer.token_ids
                    ended = answer.finish_reason is not FinishReason.NONE
                if ended:
                    engine.release(sid)
                    open_ids.remove(sid)
        out += [tokens[sid] for sid in ids]
    return out


def unwrap(answer):
    """An engine answer, or the error it carries raised."""
    if isinstance(answer, Exception):
        raise answer
    return answer

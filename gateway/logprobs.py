"""The target's log-probabilities as OpenAI's APIs show them.

The target sends token ids (``tandem.rpc.types.TokenLogprob``); a client reads each token as text
and bytes (``gateway.token_strings``). Chat (``logprobs: true``, ``top_logprobs: n``) gets
``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``; completions
(``logprobs: n``) the legacy shape ``{tokens, token_logprobs, top_logprobs: [{token: logprob}],
text_offset}``. A token's text offset is where the completion's text stood when the token came:
tokens that each hold part of one character all start where that character does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.detokenizer import IncrementalDetokenizer
from gateway.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from gateway.token_strings import TokenStrings
from tandem.rpc.types import TokenLogprob


def chat_logprobs(strings: TokenStrings, logprobs: Sequence[tuple[int, TokenLogprob]]) -> ChatLogprobs:
    """``logprobs``: (token id, its log-probabilities) of each token, in order."""
    return ChatLogprobs(content=[_chat_token(strings, lp, token_id) for token_id, lp in logprobs])


def _chat_token(strings: TokenStrings, lp: TokenLogprob, token_id: int) -> ChatTokenLogprob:
    text, raw = strings.of(token_id)
    top = []
    for other, value in zip(lp.top_token_ids, lp.top_logprobs):
        other_text, other_raw = strings.of(other)
        top.append(TopLogprob(token=other_text, logprob=value, bytes=list(other_raw)))
    return ChatTokenLogprob(token=text, logprob=lp.logprob, bytes=list(raw), top_logprobs=top)


def completion_logprobs(
    strings: TokenStrings, logprobs: Sequence[tuple[int, TokenLogprob | None, int]]
) -> CompletionLogprobs:
    """``logprobs``: (token id, its log-probabilities, its text offset) of each token; None for an
    echoed prompt's first token, which nothing scored (its value and alternatives are null)."""
    tokens, values, tops, offsets = [], [], [], []
    for token_id, lp, offset in logprobs:
        text, _ = strings.of(token_id)
        tokens.append(text)
        offsets.append(offset)
        if lp is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(lp.logprob)
        # Alternatives that decode alike (two byte pieces) share a key: the more probable one stays.
        top: dict[str, float] = {}
        for other, value in zip(lp.top_token_ids, lp.top_logprobs):
            top.setdefault(strings.of(other)[0], value)
        tops.append(top)
    return CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets)


def echoed_prompt(
    tokenizer: Any, prompt: Sequence[int], logprobs: Sequence[TokenLogprob] | None
) -> tuple[str, list[tuple[int, TokenLogprob | None, int]]]:
    """The prompt's text as a completion echoes it (decoded as a completion is), and (token,
    log-probabilities, text offset) of each prompt token for :func:`completion_logprobs`
    (``logprobs``: of every token after the first, as the target scored them; None: not asked)."""
    detokenizer = IncrementalDetokenizer(tokenizer)
    text, entries = "", []
    for i, token in enumerate(prompt):
        entries.append((token, logprobs[i - 1] if i and logprobs is not None else None, len(text)))
        text += detokenizer.push(token)
    return text + detokenizer.flush(), entries if logprobs is not None else []

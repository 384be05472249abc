"""What the client gets of a request: committed tokens turned into text, the finish, the usage.

Tokens are taken one at a time even when a speculation round commits several, so stop strings,
``max_tokens`` and the usage counts do not depend on how tokens were batched or paced: speculative
and autoregressive decoding of the same tokens give the same response.

Invariant: ``completion`` is exactly the tokens the client has been given deltas for, in order;
once ``finish_reason`` is set nothing more is taken.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any

from gateway import wire
from gateway.detokenizer import IncrementalDetokenizer
from gateway.errors import UpstreamFailure
from gateway.events import Event, Finished, SpeculationStats, TextDelta, Usage
from gateway.policy import SPECULATION_OFF, Decision, Mode
from gateway.request import GenerationRequest
from gateway.stop import StopStringMatcher
from gateway.types import Batch, FinishReason, TokenLogprob
from tandem.telemetry.metrics import Metrics

# The upstream finishes that end a request normally, as the APIs name them.
_CLIENT_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


class Output:
    def __init__(self, request: GenerationRequest, tokenizer: Any, metrics: Metrics) -> None:
        self._prompt_len = len(request.prompt_token_ids)
        self._max_tokens = request.max_tokens
        self._metrics = metrics
        self._completion: list[int] = []
        self._detokenizer = IncrementalDetokenizer(tokenizer, context_ids=request.prompt_token_ids,
                                                   skip_special_tokens=request.skip_special_tokens)
        self._stop = StopStringMatcher(request.stop, include=request.include_stop_str_in_output)
        # The text of the token that ended the answer (a stop token id, or the model's end-of-sequence
        # token) is not the answer's, as vLLM has it, unless include_stop_str_in_output; special tokens'
        # text shows only where skip_special_tokens is false.
        self._silent_stop = not request.include_stop_str_in_output
        self._min_tokens = request.min_tokens  # the answer's first tokens' text is not looked at for stop strings
        self._stats = SpeculationStats()
        self._wants_logprobs = request.top_logprobs is not None
        self._cached_prompt_tokens = 0
        self.finish_reason: str | None = None

    @property
    def completion(self) -> Sequence[int]:
        """The tokens taken so far (do not modify)."""
        return self._completion

    @property
    def usage(self) -> Usage:
        return Usage(self._prompt_len, len(self._completion), self._stats, self._cached_prompt_tokens)

    def expected_len(self, new_tokens: int) -> int:
        """The committed length of a session in step with the client after ``new_tokens`` more."""
        return self._prompt_len + len(self._completion) + new_tokens

    def entered(self, decision: Decision) -> None:
        """Notes a mode the session entered in the usage's ``speculative_decoding``."""
        self._stats.final_mode = decision.mode
        if decision.fallback_reason:
            self._stats.fallback_reason = decision.fallback_reason
            self._stats.fallbacks += decision.fallback_reason != SPECULATION_OFF  # the client's choice is no fallback

    def consume(self, batch: Batch) -> list[TextDelta]:
        """Takes a batch token by token until the request finishes; returns one delta per token
        taken (its printable text may be empty), plus one for text flushed at the finish."""
        self._observe_round(batch)
        if batch.mode is None:  # the request's own Prefill (a later one re-prefills generated tokens too)
            self._cached_prompt_tokens = min(batch.cached_tokens, self._prompt_len)
        logprobs = self._logprobs(batch)
        deltas: list[TextDelta] = []
        finish: str | None = None
        last = len(batch.token_ids) - 1
        for i, token in enumerate(batch.token_ids):
            self._completion.append(token)
            stopped_on = i == last and batch.finish_reason is FinishReason.STOP and self._silent_stop
            piece = "" if stopped_on else self._detokenizer.push(token)
            text = piece if len(self._completion) <= self._min_tokens else self._stop.push(piece)
            deltas.append(TextDelta(text, (token,), logprobs[i : i + 1]))
            if self._stop.matched is not None:
                finish = "stop"
                break
            if len(self._completion) >= self._max_tokens:
                finish = "length"
                break
        else:
            if batch.finish_reason is not FinishReason.NONE:
                finish = _client_finish(batch.finish_reason)
        if finish is not None:
            if self._stop.matched is None:
                tail = self._stop.push(self._detokenizer.flush()) + self._stop.flush()
                if self._stop.matched is not None:
                    finish = "stop"
                if tail and deltas:
                    last = deltas[-1]
                    deltas[-1] = TextDelta(last.text + tail, last.token_ids, last.logprobs)
                elif tail:
                    deltas.append(TextDelta(tail, ()))
            self.finish_reason = finish
        if batch.mode is not None and deltas:
            self._stats.modes_used.add(batch.mode)
        return deltas

    def _logprobs(self, batch: Batch) -> tuple[TokenLogprob, ...]:
        """The batch's log-probabilities, one per token, when the request asked for them."""
        if not self._wants_logprobs:
            return ()
        if len(batch.logprobs) != len(batch.token_ids):
            raise UpstreamFailure(
                f"the upstream sent {len(batch.logprobs)} log-probabilities with {len(batch.token_ids)} tokens "
                "(a target older than this gateway sends none)",
                code="upstream_error",
            )
        return tuple(batch.logprobs)

    def _observe_round(self, batch: Batch) -> None:
        if batch.num_draft_tokens > 0:
            self._stats.rounds += 1
            self._stats.draft_tokens += batch.num_draft_tokens
            self._stats.accepted_tokens += batch.num_accepted
            self._stats.prediction_drafts += batch.num_prediction_drafts
            self._stats.prediction_accepted += batch.num_prediction_accepted
            self._metrics.record_round(batch.num_draft_tokens, batch.num_accepted)
        elif batch.mode is Mode.SPECULATIVE and batch.token_ids:
            self._stats.empty_rounds += 1  # a block without drafts: the target's own token


def _client_finish(reason: FinishReason) -> str:
    if reason in _CLIENT_FINISH:
        return _CLIENT_FINISH[reason]
    raise UpstreamFailure(
        f"the upstream ended the session unexpectedly ({wire.finish_name(reason)})",
        code="upstream_error",
    )


async def joined(source: AsyncIterator[list[TextDelta] | Finished]) -> AsyncIterator[Event]:
    """Unpaced: one delta per upstream batch, as it arrives; one per token where they carry
    log-probabilities (each token's text offset is then where the text stood before it)."""
    async with aclosing(source) as items:
        async for item in items:
            if not isinstance(item, list):
                yield item
            elif any(delta.logprobs for delta in item):
                for delta in item:
                    yield delta
            else:
                yield merged(item)


def merged(deltas: Sequence[TextDelta]) -> TextDelta:
    """One delta of several consecutive ones."""
    return TextDelta(
        "".join(d.text for d in deltas),
        tuple(t for d in deltas for t in d.token_ids),
        tuple(lp for d in deltas for lp in d.logprobs),
    )

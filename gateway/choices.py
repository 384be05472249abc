"""A request's ``n`` choices: n generations of one request, run side by side and answered as one.

Each choice is a :class:`gateway.generation.Generation` of its own (its own target session,
speculation, fallback decisions and admission slot), so a choice is decoded exactly as a request of
its own would be. A sampled request with a ``seed`` gives choice i the seed ``seed + i``: the choices
differ from one another and the request repeats itself. The HTTP layer drives :class:`Choices` as it
drives one generation (start, events, usage, close); events come tagged with their choice's index,
in the order the choices produce them.

A completions request may send a batch of prompts (OpenAI's list of texts or of token-id lists):
each prompt is then a request of its own with its n choices, prompt after prompt, so choice
``i * n + j`` is prompt i's choice j, as OpenAI numbers them.

The usage is the request's: each prompt counted once, the completions' tokens and the speculation
counters summed over the choices.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing

from gateway.events import Event, SpeculationStats, Usage
from gateway.generation import Generation
from gateway.request import GenerationRequest
from gateway.validation import MAX_CHOICES  # noqa: F401 (re-exported: the most a request may ask for)

_DONE = object()


def choice_requests(request: GenerationRequest, n: int) -> list[GenerationRequest]:
    """The request of each of ``n`` choices: the same, but for a seed, which is the request's plus i."""
    seed = request.sampling.seed
    if seed is None:
        return [request] * n
    return [
        dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, seed=(seed + i) % 2**64))
        for i in range(n)
    ]


def combined_usage(usages: Sequence[Usage], per_prompt: int | None = None) -> Usage:
    """One usage for the choices, in their order (``per_prompt`` choices of each prompt of a batch;
    None: all of one prompt): each prompt once, the rest summed (each choice's mode counted)."""
    first = usages[0]
    stats = SpeculationStats(final_mode=first.speculative_decoding.final_mode)
    for usage in usages:
        s = usage.speculative_decoding
        stats.rounds += s.rounds
        stats.draft_tokens += s.draft_tokens
        stats.accepted_tokens += s.accepted_tokens
        stats.fallbacks += s.fallbacks
        stats.empty_rounds += s.empty_rounds
        stats.prediction_drafts += s.prediction_drafts
        stats.prediction_accepted += s.prediction_accepted
        stats.modes_used |= s.modes_used
        stats.fallback_reason = stats.fallback_reason or s.fallback_reason
    prompts = usages[:: per_prompt or len(usages)]
    return Usage(sum(u.prompt_tokens for u in prompts), sum(u.completion_tokens for u in usages), stats,
                 sum(u.cached_prompt_tokens for u in prompts))


SHARED_PROMPT_TOKENS = 64  # a shorter prompt prefills side by side sooner than after the first choice's


async def _start(generations: Sequence[Generation]) -> None:
    """Prefills the choices of one prompt (see :meth:`Choices.start`)."""
    first, rest = generations[0], generations[1:]
    if rest and len(first.request.prompt_token_ids) >= SHARED_PROMPT_TOKENS:
        await first.start()
        await asyncio.gather(*(g.start() for g in rest))
    else:
        await asyncio.gather(*(g.start() for g in generations))


class Choices:
    def __init__(self, generations: Sequence[Generation], per_prompt: int | None = None) -> None:
        """``generations``: prompt after prompt, ``per_prompt`` (the request's n) of each; None:
        all of one prompt (a batch of prompts comes only to completions)."""
        self.per_prompt = per_prompt or len(generations)
        if not generations or len(generations) % self.per_prompt:
            raise ValueError("a request has at least one choice, n of each prompt")
        self.generations = list(generations)

    @property
    def request(self) -> GenerationRequest:
        return self.generations[0].request

    @property
    def session_id(self) -> str:
        return self.generations[0].session_id

    @property
    def usage(self) -> Usage:
        return combined_usage([g.usage for g in self.generations], self.per_prompt)

    async def start(self) -> None:
        """Prefills every choice; raises what the first failure raised. Choices of a prompt long
        enough to share are prefilled after the prompt's first: the target then starts them from a
        copy of its cache (``SessionStore.shared_prefix``) and prefills only their last token."""
        step = self.per_prompt
        await asyncio.gather(*(_start(self.generations[i : i + step]) for i in range(0, len(self.generations), step)))

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        """(choice index, event) as the choices produce them; each choice's events end with its
        :class:`gateway.events.Finished`. A choice's failure ends them all (and is raised)."""
        if len(self.generations) == 1:
            async with aclosing(self.generations[0].events()) as events:
                async for event in events:
                    yield 0, event
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, generation: Generation) -> None:
            try:
                async with aclosing(generation.events()) as events:
                    async for event in events:
                        queue.put_nowait((index, event))
            except Exception as error:  # noqa: BLE001 (handed to the reader, which raises it)
                queue.put_nowait((index, error))
            finally:
                queue.put_nowait((index, _DONE))

        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(self.generations)]
        try:
            running = len(tasks)
            while running:
                index, item = await queue.get()
                if item is _DONE:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def aclose(self) -> None:
        await asyncio.gather(*(g.aclose() for g in self.generations))

    async def __aenter__(self) -> Choices:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

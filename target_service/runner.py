"""The target model's forward passes, and the scores of the rows they feed.

The engine decides what each session feeds (a :class:`Step`); the runner runs every step of one
pass through the model, alone through transformers' path or together through
``target_service.ragged``, and gives back each step's :class:`RowScores` and the hidden states it
asked for. It owns the model and what was chosen for its device: the attention, the verifier
(``target_service.verifier``) and the greedy head: a bfloat16 screen of a float32 LM head
(``tandem.cpu.screened_head``) or a quantized head run only over the rows a verdict can reach
(``target_service.greedy_waves``).

Invariant: a pass appends each step's ``token_ids`` to its session's cache and does nothing else to
the session; which path runs a step changes no token (the logits agree up to float summation
order). A pass that fails hands each session whose cache it may have half-written to
``on_broken`` and raises.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kernels.hf_attention import install_on_cuda
from kernels.reference import draw_uniforms, is_greedy
from tandem.cpu.screened_head import ScreenedArgmax, screened_argmax_for
from tandem.models import LoadedModel
from tandem.quant.modules import int8_activations
from target_service import gemma_pass, kv_cache, ragged
from target_service.greedy_waves import GreedyRows, GreedyWaves
from target_service.model_info import sliding_window
from target_service.grammar import MaskRows
from target_service.session import SamplingTensors, Session, SessionConfig, make_generator
from target_service.verifier import select_verifier

# A longer lone step (a prompt chunk) keeps transformers' causal SDPA path, unless the runner is
# row-exact: then a prompt is computed the same way alone and beside other sessions.
RAGGED_LONE_MAX_ROWS = 16


@dataclass(frozen=True)
class RowScores:
    """What the LM head gave a step's scored rows: their logits, or for a greedy session only each
    row's argmax, all greedy decoding uses, where the runner has a faster way to it than the
    verifier's (a screened head, ``tandem.cpu.screened_head``, or a native argmax over the logits)
    (neither for a step that scores no rows)."""

    logits: torch.Tensor | None = None  # [rows, vocab]
    argmax: torch.Tensor | None = None  # [rows] int64; the greedy tokens, whether or not logits came too


@dataclass
class Step:
    """A session's rows in a forward pass, and which of their outputs it needs."""

    session: Session
    token_ids: list[int]  # fed after the session's cache: its last committed token, then any drafts
    want_hidden: bool
    last_only: bool = False  # scores of the last row only (a prefill chunk, a decode step)
    screened: bool = False  # argmax only, through the runner's screened head (greedy sessions)
    scored: bool = True  # False: no scores at all (a prompt chunk before the last)
    tree: tuple[int, ...] | None = None  # token_ids as a token tree (target_service.tree.forward_parents)

    @property
    def no_logits(self) -> bool:
        """The LM head's float32 product is not needed: screened rows, or none scored."""
        return self.screened or not self.scored

    @property
    def needs_hidden(self) -> bool:
        """The pass must return this step's final hidden states: asked for, or to be screened."""
        return self.want_hidden or (self.screened and self.scored)


class ModelRunner:
    """Runs the target model over the steps of a pass and scores their rows."""

    def __init__(self, loaded: LoadedModel, *, screened_head: bool, on_broken: Callable[[Session], None]) -> None:
        """``screened_head``: greedy sessions take their tokens from a bfloat16 screen of the LM head
        rescored exactly where the model and device allow it. ``on_broken``: called with each
        session whose cache a failed pass may have half-written."""
        self.model = loaded.model
        self.device = loaded.device
        self._on_broken = on_broken
        # On CUDA the model's attention becomes the Triton tree-attention kernel (a chain by default);
        # on every device it also learns to run several sessions in one pass (forward_steps).
        install_on_cuda(self.model, loaded.device)
        self.batched = ragged.install(self.model) is not None  # else forward_steps runs its steps one by one
        self.attention = self.model.config._attn_implementation
        text_config = loaded.model.config.get_text_config()
        self.vocab_size = int(text_config.vocab_size)
        # Past the sliding window a lone decode or verify step is cheaper through the ragged path
        # over SDPA: its sliding layers read only the window's keys, where transformers' mask makes
        # them read every key. Tandem's own tree attention (CUDA) applies the window itself, so
        # there lone steps keep the ordinary path.
        sdpa = self.attention == ragged.PREFIX + "sdpa"
        self.ragged_after = sliding_window(text_config) if sdpa else None
        # int8 activations turn a multi-row pass's rounding noise into changed tokens: then every
        # pass, a decode step and a lone prompt chunk included, runs through ragged.forward attending
        # row by row, so what a session computes never depends on the sessions beside it in a pass.
        self.row_exact = sdpa and int8_activations(self.model)
        # A quantized Gemma 3 runs ragged passes without transformers' module tree (gemma_pass): a
        # lone short step is then cheaper through ragged.forward whatever its kernel.
        self.lean = self.batched and sdpa and gemma_pass.for_model(self.model) is not None
        self.verifier = select_verifier(loaded.device)
        self.greedy_head: ScreenedArgmax | GreedyWaves | None = (
            screened_argmax_for(self.model, loaded.device) if screened_head else None
        )
        # Greedy rows' argmax over the logits from the pass's native ops (decoder_ops.cpp: vectorised,
        # torch.argmax's ties and NaN rule), cheaper than torch's over a large vocabulary (figures:
        # benchmarks/RESULTS.md, 2026-12-03).
        lean_pass = gemma_pass.for_model(self.model) if self.lean else None
        self.argmax_rows: Callable[[torch.Tensor], torch.Tensor] | None = (
            getattr(lean_pass.ops, "argmax_rows", None) if lean_pass is not None else None
        )
        # A constrained session's grammar mask applied in one native pass over its rows' logits.
        self.mask_rows: MaskRows | None = getattr(lean_pass.ops, "mask_rows", None) if lean_pass is not None else None
        # On quantized weights greedy sessions score only the rows their verdict can reach
        # (target_service.greedy_waves), the LM head in waves of one read of its weight each.
        if self.greedy_head is None and screened_head and self.argmax_rows is not None:
            kernel = getattr(lean_pass.lm_head, "kernel", None)
            if kernel is not None:
                self.greedy_head = GreedyWaves(lean_pass.logits, self.argmax_rows, kernel.rows_per_sweep)

    def screens(self, session: Session) -> bool:
        """Whether the session's tokens come from the greedy head (a screen, or the quantized head in
        waves): greedy, the runner has one, and the session wants no log-probabilities and has no
        grammar, penalties or bias (the head yields each row's argmax, no logits to mask, penalise or
        bias)."""
        return (
            self.greedy_head is not None
            and session.config.top_logprobs is None
            and not session.reshapes_logits
            and bool(is_greedy(session.sampling.temperature)[0])
        )

    @torch.inference_mode()
    def forward(
        self,
        session: Session,
        token_ids: Sequence[int],
        last_only: bool = False,
        want_hidden: bool = False,
        no_logits: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Runs the model over ``token_ids`` after the session's cache, appending to the cache.

        Returns the logits ``[n, vocab]`` (``[1, vocab]`` with ``last_only``, ``[0, vocab]`` with
        ``no_logits``) and, with ``want_hidden``, the final hidden states ``[n, hidden_size]`` (after
        the final norm: what the LM head multiplies, the features an EAGLE-style drafter is
        conditioned on).
        """
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)  # [1, n]
        keep: int | torch.Tensor = 1 if last_only else 0
        if no_logits:
            keep = torch.empty(0, dtype=torch.long, device=self.device)  # the LM head over no rows
        try:
            out = self.model(
                input_ids=input_ids,
                cache=session.cache,
                use_cache=True,
                output_hidden_states=want_hidden,
                logits_to_keep=keep,
            )
        except Exception:
            # A pass that failed half-way (out of memory, say) may have grown some layers of the
            # cache and not others; the session cannot go on correctly, so it is dropped.
            self._on_broken(session)
            raise
        logits = out.logits[0]  # [n, vocab] or [1, vocab]
        hidden = out.hidden_states[-1][0] if want_hidden else None  # [n, hidden_size]
        return logits, hidden

    def forward_steps(self, steps: Sequence[Step]) -> list[tuple[RowScores, torch.Tensor | None]]:
        """Each step's scores and hidden states ``[n, hidden_size]`` (None unless it asked), from
        one forward pass. A session alone runs as :meth:`forward` does, except a short step past
        the sliding window, which the ragged path runs faster (the same logits up to float
        summation order), and every step of a row-exact runner (see ``_ragged_pays``)."""
        if not self.batched or (len(steps) == 1 and steps[0].tree is None and not self._ragged_pays(steps[0])):
            outputs = [
                self.forward(
                    step.session,
                    step.token_ids,
                    last_only=step.last_only,
                    want_hidden=step.needs_hidden,
                    no_logits=step.no_logits,
                )
                for step in steps
            ]
            return self._score(steps, outputs)
        try:
            with torch.inference_mode():
                logits, hidden = ragged.forward(
                    self.model,
                    [step.session.cache for step in steps],
                    [step.token_ids for step in steps],
                    self.device,
                    want_hidden=any(step.needs_hidden for step in steps),
                    last_only=[step.last_only for step in steps],
                    no_logits=[step.no_logits for step in steps],
                    trees=[step.tree for step in steps],
                    row_exact=self.row_exact,
                )
        except Exception:
            # As in forward: caches may have grown in some layers and not others.
            for step in steps:
                self._on_broken(step.session)
            raise
        return self._score(steps, [(rows, hidden[i] if hidden is not None else None) for i, rows in enumerate(logits)])

    def warmup(self) -> None:
        """One forward pass and one verification, so the first request pays no lazy set-up."""
        config = SessionConfig(max_new_tokens=8, temperature=1.0, top_p=0.9, top_k=8, seed=0)
        session = Session(
            session_id="",
            config=config,
            prompt_len=8,
            tokens=[0] * 8,
            cache=kv_cache.new_cache(),
            generator=make_generator(0, self.device),
            sampling=SamplingTensors.of(config, self.device),
        )
        logits, hidden = self.forward(session, session.tokens, want_hidden=self.greedy_head is not None)  # [8, vocab]
        if self.greedy_head is not None:
            self._greedy_tokens([GreedyRows.of(hidden, session.tokens)])  # oneDNN builds a screen's kernels now
        # A sampling session's draws, as target_service.acceptance.randomness takes them.
        uniforms = draw_uniforms((1, 7), session.generator)  # [1, 7]
        draws = self.verifier.token_draws(1, self.vocab_size, session.generator)  # the next token's draw
        drafts = torch.zeros(1, 7, dtype=torch.long, device=self.device)  # [1, 7]
        self.verifier.verify_chain(
            logits[None],  # [1, 8, vocab]
            drafts,
            drafts[..., None],  # [1, 7, 1]
            torch.ones(1, 7, 1, device=self.device),
            session.sampling.temperature,
            session.sampling.top_p,
            session.sampling.top_k,
            uniforms,
            draws,
        )

    def _score(
        self, steps: Sequence[Step], outputs: Sequence[tuple[torch.Tensor, torch.Tensor | None]]
    ) -> list[tuple[RowScores, torch.Tensor | None]]:
        """Turns (logits, hidden) per step into (scores, the hidden states it asked for): screened
        steps get the argmax of their scored rows, all of the pass's through one screen (one read
        of its weights for every greedy session in the pass)."""
        screened = [
            GreedyRows.of(hidden[-1:], step.token_ids[-1:]) if step.last_only
            else GreedyRows.of(hidden, step.token_ids, step.tree)  # hidden: [scored rows, hidden_size]
            for step, (_, hidden) in zip(steps, outputs)
            if step.screened and step.scored
        ]
        tokens = iter(self._greedy_tokens(screened) if screened else ())
        return [
            (
                RowScores()
                if not step.scored
                else RowScores(argmax=next(tokens))
                if step.screened
                else RowScores(logits=logits, argmax=self.argmax_rows(logits))  # logits: for log-probabilities
                if self._native_argmax(step, logits)
                else RowScores(logits=logits),
                hidden if step.want_hidden else None,
            )
            for step, (logits, hidden) in zip(steps, outputs)
        ]

    def _greedy_tokens(self, steps: Sequence[GreedyRows]) -> list[torch.Tensor]:
        """Each screened step's row tokens ([n] each), all of the pass's through one head: one read
        of the screen's weights, or of the quantized head's per wave."""
        if isinstance(self.greedy_head, GreedyWaves):
            return self.greedy_head(steps)
        hidden = torch.cat([step.hidden for step in steps])  # [rows, hidden_size]
        return list(self.greedy_head(hidden).split([len(step.tokens) for step in steps]))

    def _native_argmax(self, step: Step, logits: torch.Tensor) -> bool:
        """Whether a greedy step's rows take their argmax from ``argmax_rows``."""
        return (
            self.argmax_rows is not None
            and logits.dtype == torch.float32
            and logits.dim() == 2
            and logits.shape[1] > 0
            and logits.stride(1) == 1
            and not step.session.reshapes_logits  # its argmax is over masked, penalised or biased logits
            and bool(is_greedy(step.session.sampling.temperature)[0])
        )

    def _ragged_pays(self, step: Step) -> bool:
        """Whether a session alone runs through ``ragged.forward`` rather than :meth:`forward`: it is
        faster past the sliding window or without the module tree (``lean``), and it is the row-exact
        path (``row_exact``, at any length). A row-exact runner computes every row, a prompt's too,
        as a one-token step at its position would, so a prompt prefilled alone fills the cache bit
        for bit as one prefilled beside other sessions' steps does; through the module tree it would
        differ by rounding, which int8 activations turn into other tokens: a greedy answer would
        depend on the server's load (and on whether the session speculated)."""
        if self.row_exact:
            return True
        return len(step.token_ids) <= RAGGED_LONE_MAX_ROWS and (
            self.lean
            or (self.ragged_after is not None and kv_cache.cache_length(step.session.cache) > self.ragged_after)
        )

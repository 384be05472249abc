"""Greedy decoding's next token without the float32 LM head: a bfloat16 screen, then exact
scores for the few tokens that can still win.

A greedy row needs one thing from the LM head: the index of its largest logit. On a CPU the head
is the largest read of a pass (gemma-3-270m: a [262144, 640] float32 matrix, 671 MB).
:class:`ScreenedArgmax` reads a bfloat16 copy instead (half the bytes; oneDNN's
bf16 product on AVX512-BF16 also has twice the arithmetic rate, which matters for the 5-8 rows
of a verification, where the float32 product turns compute-bound), then rescores in float64 the
candidates the rounding could have hidden the winner among, and returns their argmax.

Why that is exact. For a row ``x`` and a vocabulary row ``w`` the screen computes
``s = bf16(sum_i bf16(w_i) * bf16(x_i))`` with float32 accumulation. With ``u = 2**-8``
(bfloat16's unit roundoff) and ``g ~ n * 2**-24`` (float32 accumulation over n terms), its
distance to the exact ``y = w . x`` is at most ``E + o|s|`` with ``E = (2u + u^2 + g(1+u)^2)
max|w| |x|`` (Cauchy-Schwarz, the largest row norm) and ``o = 2u/(1-2u)`` (the output's
rounding to bfloat16, to nearest or even by truncation).
Let ``h`` be the row's largest screen and ``B = (E + o|h|) / (1 - 2o)``: every token whose screen
lies within ``2B`` of ``h`` has ``|s| <= |h| + 2B`` and so an error of at most ``B``, as has the
top one. The true argmax ``v*`` has ``s[v*] + B >= y[v*] >= y[top] >= h - B``, so it is among the
tokens whose screen reaches ``h - 2B``, the candidates. Candidates are rescored as float64 dot
products of the float32 weights and hidden state (products of float32 are exact in float64, sums
of a few hundred of them good to ~1e-13), and the first index of the largest wins, as
``torch.argmax`` breaks ties.

So the token is the argmax of the exact logits; the float32 product it replaces differs from them
by float rounding (~1e-5 on logits of ~30, and by summation order between its own one- and
many-row paths), which can only matter at a tie that close. Autoregressive steps and
verification both pick tokens here, so speculative and plain greedy decoding agree token for
token. Candidates are few (a handful per row), so the rescoring costs little beside the screen.
Figures (candidates per row, head and pass times; ``benchmarks/screened_head.py`` re-measures
them): docs/target.md#screened-head.

Rows whose screen finds no candidate (a non-finite hidden state) take the float32 product, as
before. Sampling needs every probability, so sampled rows keep the float32 head (the engine
decides which rows come here).
"""

from __future__ import annotations

import logging

import torch

from tandem.cpu.linear import PAD, pack_weight, packed_linear, padded_linear
from tandem.cpu.row_plans import tune_screen_rows

log = logging.getLogger(__name__)

MIN_BYTES = 64 * 2**20  # float32 heads smaller than this are read fast enough as they are
_UNIT = 2.0**-8  # bfloat16 unit roundoff (8 significant bits, round to nearest)
_ACCUMULATION = 2.0**-24  # float32 unit roundoff, once per accumulated term
BLOCK = 128  # tokens per block of the candidate search
_SLACK = 1e-5  # absolute: flushed subnormal products, and the threshold's own float32 rounding


class ScreenedArgmax:
    """``argmax(hidden @ weight.T, dim=-1)`` exactly, reading a bfloat16 copy of ``weight``."""

    def __init__(self, weight: torch.Tensor) -> None:
        """``weight``: [vocab, hidden] float32, kept by reference (the candidates' rows are read
        from it); the screen is a bfloat16 copy made now, so later changes to it are not seen."""
        if weight.dtype != torch.float32 or weight.dim() != 2:
            raise ValueError(f"need a [vocab, hidden] float32 weight, got {weight.dtype} {tuple(weight.shape)}")
        self.weight = weight.detach()  # [vocab, hidden] float32
        screen = self.weight.to(torch.bfloat16)  # [vocab, hidden]
        # oneDNN's packed copy where it can make one; F.linear over the plain copy otherwise.
        self._packed = pack_weight(screen)
        self._screen = screen if self._packed is None else None
        hidden = self.weight.shape[1]
        max_norm = float(self.weight.norm(dim=1).max())
        accumulation = hidden * _ACCUMULATION / (1 - hidden * _ACCUMULATION)
        # |screen - y| <= relative * |x| + output * |screen| + _SLACK for every vocabulary row.
        self._relative = (2 * _UNIT + _UNIT**2 + accumulation * (1 + _UNIT) ** 2) * max_norm
        self._output = 2 * _UNIT / (1 - 2 * _UNIT)  # the output's rounding to bfloat16, even by truncation
        # Row counts whose product runs padded to four rows (``tandem.cpu.row_plans.tune_screen_rows``).
        self.row_plan: dict[int, str] = {}

    @property
    def packed(self) -> bool:
        """Whether the screen runs through oneDNN's packed product (the fast path it is for)."""
        return self._packed is not None

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    @torch.inference_mode()
    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] (any float dtype, rounded to float32 first) -> [n] int64 token ids."""
        x = hidden.reshape(-1, hidden.shape[-1]).float()  # [n, hidden]
        n = x.shape[0]
        if n == 0:
            return torch.empty(0, dtype=torch.long, device=x.device)
        screen = self.screen_logits(x.to(torch.bfloat16))  # [n, vocab] bfloat16
        rows, cols = self._candidates(screen, x.norm(dim=1))  # [c] each
        exact = (self.weight.index_select(0, cols).double() * x.index_select(0, rows).double()).sum(dim=1)  # [c]
        best = torch.full((n,), float("-inf"), dtype=torch.float64).scatter_reduce(0, rows, exact, "amax")  # [n]
        vocab = self.vocab_size
        winners = torch.where(exact == best.index_select(0, rows), cols, torch.full_like(cols, vocab))  # [c]
        tokens = torch.full((n,), vocab, dtype=torch.long).scatter_reduce(0, rows, winners, "amin")  # [n]
        lost = (tokens == vocab).nonzero(as_tuple=True)[0]  # rows without a finite candidate
        if lost.numel():
            tokens[lost] = torch.nn.functional.linear(x.index_select(0, lost), self.weight).argmax(dim=1)
        return tokens

    def _candidates(self, screen: torch.Tensor, norms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, token) pairs whose screen reaches its row's ``max - 2B`` (``norms``: |x| [n]).

        Found block-wise: a max per block of ``BLOCK`` tokens (a vectorised reduction), then
        only the blocks that reach the threshold are searched; a plain ``nonzero`` over the whole
        [n, vocab] mask costs more than the screen saves on its last rows.
        """
        n, vocab = screen.shape
        whole = vocab - vocab % BLOCK
        maxima = [screen[:, :whole].reshape(n, whole // BLOCK, BLOCK).amax(dim=2)] if whole else []  # [n, blocks]
        if whole < vocab:
            maxima.append(screen[:, whole:].amax(dim=1, keepdim=True))  # [n, 1]: the tail, as one block
        block_max = torch.cat(maxima, dim=1) if len(maxima) > 1 else maxima[0]  # [n, blocks]
        high = block_max.amax(dim=1).float()  # [n]
        # A candidate's screen lies within 2B of ``high``, so its own rounding is within B too.
        bound = (self._relative * norms + self._output * high.abs()) / (1 - 2 * self._output) + _SLACK  # [n]
        threshold = high - 2 * bound  # [n]; NaN where the row is not finite: no candidates
        block_rows, blocks = (block_max >= threshold[:, None]).nonzero(as_tuple=True)  # [b] each
        starts = blocks * BLOCK  # [b]
        offsets = torch.arange(BLOCK)  # [BLOCK]
        cols = (starts[:, None] + offsets).clamp_max(vocab - 1)  # [b, BLOCK] (the tail block repeats its last id)
        inside = (starts[:, None] + offsets < vocab) & (
            screen[block_rows[:, None], cols] >= threshold.index_select(0, block_rows)[:, None]
        )  # [b, BLOCK]
        hit_blocks, hit_offsets = inside.nonzero(as_tuple=True)  # [c] each
        return block_rows.index_select(0, hit_blocks), cols[hit_blocks, hit_offsets]

    def screen_logits(self, x: torch.Tensor, plan: str | None = None) -> torch.Tensor:
        """x [n, hidden] bfloat16 -> [n, vocab] bfloat16, through ``plan`` (default: ``row_plan``'s)."""
        if self._packed is not None:
            if (plan or self.row_plan.get(x.shape[0])) == PAD:
                return padded_linear(x, self._packed)
            return packed_linear(x, self._packed)
        return torch.nn.functional.linear(x, self._screen)


def screened_argmax_for(model: torch.nn.Module, device: str, min_bytes: int = MIN_BYTES) -> ScreenedArgmax | None:
    """A screened argmax for ``model``'s LM head where it pays and is exact: a float32 head on the
    CPU of at least ``min_bytes``, no final logit soft-capping (tanh can round two logits to one
    float, which the float32 argmax breaks by index and the exact one would not), oneDNN able to
    pack its bfloat16 copy, and the screen agreeing with the float32 product on a check."""
    if not str(device).startswith("cpu"):
        return None
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return None  # before reading ``weight``: a quantized head's is a float32 copy made on each read
    weight = head.weight
    if weight.dtype != torch.float32 or weight.numel() * weight.element_size() < min_bytes:
        return None
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(text_config, "final_logit_softcapping", None):
        return None
    screened = ScreenedArgmax(weight)
    if not screened.packed:
        log.info("greedy tokens read the float32 LM head: oneDNN cannot pack its bfloat16 copy here")
        return None
    if not _agrees(screened):
        log.warning("greedy tokens read the float32 LM head: its bfloat16 screen failed its check")
        return None
    tune_screen_rows(screened, model)
    log.info(
        "greedy tokens through a bfloat16 screen of the LM head (%.0f MB more), rescored exactly",
        weight.numel() * 2 / 2**20,
    )
    return screened


def _agrees(screened: ScreenedArgmax, rows: int = 8) -> bool:
    """Whether the screen picks the float32 product's tokens for a few rows of its own weights
    (scaled, so each row has a clear winner), and runs at all."""
    generator = torch.Generator().manual_seed(0)
    picks = torch.randint(0, screened.vocab_size, (rows,), generator=generator)  # [rows]
    x = screened.weight.index_select(0, picks) * 4.0 + 0.01 * torch.randn(
        rows, screened.weight.shape[1], generator=generator
    )  # [rows, hidden]
    try:
        got = screened(x)
    except RuntimeError as error:
        log.warning("bfloat16 screen of the LM head failed: %s", error)
        return False
    want = torch.nn.functional.linear(x, screened.weight).argmax(dim=1)
    return bool(torch.equal(got, want))

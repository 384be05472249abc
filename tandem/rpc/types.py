"""The values both ends of a hop mean the same thing by: one class per meaning, no protobuf.

The draft sends a :class:`DraftBlock` and reads a :class:`Verdict`; the target reads the block and
sends the verdict; the gateway, the draft and the target agree on :class:`SessionParams` (with its
:class:`SamplingParams`) and :class:`FinishReason`. Each service works on these (and on its own dataclasses), and converts to
and from ``tandem.v1`` messages only at its edge, through :mod:`tandem.rpc.codecs`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class FinishReason(enum.Enum):
    """Why a session stopped growing (``tandem.v1.FinishReason``)."""

    NONE = "none"  # not finished yet
    STOP = "stop"  # an end-of-sequence or stop token was committed (it is included)
    LENGTH = "length"  # the session's token budget is spent
    CANCELLED = "cancelled"  # released or cancelled before it finished

    @property
    def finished(self) -> bool:
        return self is not FinishReason.NONE


class VerdictStatus(enum.Enum):
    """What the target did with a block (``tandem.v1.VerdictStatus``)."""

    OK = "ok"
    STALE = "stale"  # the block did not extend the committed sequence; nothing changed
    FINISHED = "finished"  # the session had already finished; nothing changed


@dataclass(frozen=True)
class SamplingParams:
    """A session's sampling parameters; temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 0.0  # 0 or 1: no nucleus truncation
    top_k: int = 0  # 0: no top-k truncation
    seed: int | None = None  # None: the session draws a fresh random seed
    min_p: float = 0.0  # in [0, 1]; 0: none (target_service.min_p)
    typical_p: float = 0.0  # in [0, 1]; 0 or 1: none (target_service.typical_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class GrammarKind(enum.Enum):
    """The notation a :class:`Grammar`'s ``spec`` is written in (``tandem.v1.GrammarKind``)."""

    JSON_SCHEMA = "json_schema"  # a JSON Schema document: the text is one JSON value it validates
    REGEX = "regex"  # a regular expression the whole text matches
    EBNF = "ebnf"  # an EBNF grammar (GBNF notation) whose rule "root" the whole text matches


@dataclass(frozen=True)
class Grammar:
    """What a constrained session's generated text must be (structured output).

    The target masks every row it scores to the tokens that keep the text a prefix of a sentence of
    the grammar and allows an end-of-sequence token only where the text is complete, so a
    constrained session draws from the target's distribution renormalised over the allowed tokens,
    speculative or not.
    """

    kind: GrammarKind
    spec: str


@dataclass(frozen=True)
class SessionParams:
    """What a target session is fixed with at its ``Prefill`` (and the draft is told in ``Speculate``)."""

    sampling: SamplingParams
    # Tokens the session may generate in total, its first token (from Prefill) included: the
    # session's budget, not a call's (a Speculate or Generate call's own max_new_tokens bounds
    # that call only).
    max_new_tokens: int
    ignore_eos: bool = False  # do not stop on the model's end-of-sequence tokens
    stop_token_ids: tuple[int, ...] = ()  # further tokens that end the session (included)
    # Report each committed token's log-probability and those of the top_logprobs most probable
    # tokens at its position (0..MAX_TOP_LOGPROBS); None: no log-probabilities.
    top_logprobs: int | None = None
    grammar: Grammar | None = None  # constrain the output to a grammar (structured output)
    # OpenAI's penalties (-2..2): each token's logit loses presence_penalty if the generated text holds
    # it and frequency_penalty per occurrence there. 0: none.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # The prompt's last tokens that are this generation's own output so far (a session a gateway
    # moved to another target or resynced): the grammar and the penalties count them. 0: none.
    continued_tokens: int = 0
    # OpenAI's logit_bias: (token id, bias) pairs in increasing token id order, each bias in
    # [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] added to that token's logit at every step. (): none.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's min_tokens: the session's first min_tokens tokens (counted like max_new_tokens) are not
    # stop tokens (EOS unless ignore_eos, and stop_token_ids): their logits are masked. 0: none.
    min_tokens: int = 0
    # The repetition penalty of HF transformers, vLLM and TGI, in (0, MAX_REPETITION_PENALTY]: the logit
    # of each token the prompt or the generated text holds is divided by it where positive, multiplied
    # by it where negative. 1: none.
    repetition_penalty: float = 1.0
    # vLLM's bad_words as token sequences (each 1..MAX_BAD_WORD_TOKENS ids, at most MAX_BAD_WORDS):
    # where the generated text ends with all of a sequence but its last token, that token is masked. (): none.
    bad_words: tuple[tuple[int, ...], ...] = ()
    # vLLM's allowed_token_ids, in increasing order: every other token is masked. (): all tokens.
    allowed_token_ids: tuple[int, ...] = ()


MAX_TOP_LOGPROBS = 20  # as OpenAI's chat API allows
# The longest grammar spec accepted: compiling one takes time that grows with it (a JSON schema of a
# few KB, a second or two with a 262k vocabulary), so a larger one is refused before it is compiled.
MAX_GRAMMAR_CHARS = 65536
MAX_PENALTY = 2.0  # presence and frequency penalties are in [-MAX_PENALTY, MAX_PENALTY], as OpenAI's
MAX_REPETITION_PENALTY = 2.0  # a repetition penalty is in (0, MAX_REPETITION_PENALTY]
MAX_BAD_WORDS = 1024  # token sequences a session may ban (a word is one or two of them: gateway.token_masks)
MAX_BAD_WORD_TOKENS = 64  # tokens in one banned sequence
MAX_LOGIT_BIAS = 100.0  # a logit bias is in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS], as OpenAI's
MAX_PREDICTION_TOKENS = 65536  # the longest predicted output a draft copies from (an answer longer is not asked for)


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probabilities at one committed token's position: of the token itself and of
    the most probable tokens there, most probable first (``top_token_ids[i]`` has ``top_logprobs[i]``).

    From the model's own distribution (the log-softmax of its logits, before temperature, top-k or
    top-p): what the target computes whichever way the token was reached, so a speculative and an
    autoregressive session report the same values for the same tokens (up to float rounding
    between passes of different widths).
    """

    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class SparseDist:
    """A proposal distribution q at one draft position: ``probs[i]`` on ``token_ids[i]``, zero
    elsewhere (the draft samples from a renormalised top-k)."""

    token_ids: tuple[int, ...]
    probs: tuple[float, ...]


@dataclass(frozen=True)
class DraftBlock:
    """One Verify request: draft tokens that extend exactly ``committed[:base_len] + assumed_token_ids``."""

    session_id: str
    base_len: int
    draft_token_ids: tuple[int, ...]
    assumed_token_ids: tuple[int, ...] = ()
    # One q per draft token; empty = one-hot q on each draft token (a deterministic drafter).
    draft_probs: tuple[SparseDist, ...] = ()
    block_id: int = 0
    tokenizer_fingerprint: str = ""  # the drafter's; empty = not checked
    # Return this block's hidden states even when the session was not prefilled asking for them.
    return_hidden_states: bool = False
    # A token tree: each draft's parent (an earlier draft's index, or -1 for the last committed
    # token). Empty: a chain.
    draft_parents: tuple[int, ...] = ()


@dataclass(frozen=True)
class Verdict:
    """One Verify response."""

    block_id: int
    status: VerdictStatus
    committed_len: int = 0  # after this verdict (STALE: the target's current length)
    # Committed draft tokens: committed_token_ids[:num_accepted] == draft_token_ids[:num_accepted],
    # then one recovered or bonus token (fewer when the session finished).
    num_accepted: int = 0
    committed_token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason = FinishReason.NONE
    # [len(committed_token_ids), hidden_size] (OK verdicts, when asked for): row i is the final
    # hidden state at the position whose logits produced committed_token_ids[i], i.e. the last
    # token committed before the block (row 0) and the accepted draft tokens (rows 1..). An empty
    # block gives one row.
    hidden_states: torch.Tensor | None = field(default=None, compare=False, repr=False)
    verify_seconds: float = 0.0
    # The pass the block was verified in, every session's share included (0: not reported): its
    # rows and the tokens it committed; equal to this block's own when it had the pass alone.
    pass_rows: int = 0
    pass_tokens: int = 0
    # What a pass of one row per session would cost, estimated by the target from its measured
    # passes (0: not reported): the step a session would take decoding autoregressively now.
    step_seconds: float = 0.0
    # One per committed token when the session asked for them (SessionParams.top_logprobs), else ().
    logprobs: tuple[TokenLogprob, ...] = ()

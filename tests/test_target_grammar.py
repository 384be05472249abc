"""Structured output in the target: every row a constrained session scores allows exactly the tokens
that keep its text a prefix of the grammar's language, and speculation keeps what decoding gives
(greedy: the same tokens; sampled: the same distribution, checked against an enumeration that does
not use the grammar library); on tiny random Llama and Gemma 3 targets and over gRPC's conversion."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
from scipy import stats

from tandem.models import load_model
from tandem.rpc import codecs
from tandem.rpc.types import SessionParams, SamplingParams
from target_service import wire
from target_service.engine import TargetEngine
from target_service.errors import InvalidArgument
from target_service.session import SessionConfig
from target_service.types import DraftBlock, FinishReason, Grammar, GrammarKind
from engine_sessions import decode_step, run_together
from test_target_engine import _prompt as prompt_ids
from test_quant_model import quantized_gemma  # noqa: F401 (a fixture)
from test_target_tree import random_tree

REGEX = Grammar(GrammarKind.REGEX, "(cat|dog|fish)(s|es)?")
LANGUAGE = {stem + ending for stem in ("cat", "dog", "fish") for ending in ("", "s", "es")}  # REGEX's words
PREFIXES = {word[:i] for word in LANGUAGE for i in range(len(word) + 1)}
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}



@pytest.fixture(scope="module", params=["llama", "gemma"])
def loaded(request, tiny_dir, tiny_gemma_dir):
    return load_model(str(tiny_dir if request.param == "llama" else tiny_gemma_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def engine(loaded) -> TargetEngine:
    return TargetEngine(loaded)


def token_texts(tokenizer, vocab_size: int) -> list[str]:
    return [tokenizer.decode([t]) for t in range(vocab_size)]


def allowed_after(text: str, texts: list[str], eos: set[int]) -> set[int]:
    """By brute force over the finite language: the tokens that keep ``text`` a prefix of a word,
    and end of sequence where ``text`` is a word."""
    allowed = {t for t, piece in enumerate(texts) if piece and text + piece in PREFIXES and t not in eos}
    return allowed | (eos if text in LANGUAGE else set())


def decode(engine: TargetEngine, prompt: list[int], config: SessionConfig, session_id: str) -> list[int]:
    tokens = [engine.prefill(session_id, prompt, config).token_id]
    while True:
        result = engine.generate(session_id, 8)
        tokens += result.token_ids
        if result.finish_reason is not FinishReason.NONE:
            engine.release(session_id)
            return tokens


def speculate(engine: TargetEngine, prompt: list[int], config: SessionConfig, session_id: str, rng: random.Random,
              guide: list[int]) -> list[int]:
    """Random chains and trees, mixing ``guide`` (a continuation that the grammar allows) with random
    tokens, most of which it forbids."""
    return run_together(engine, prompt, [config], random_blocks(engine, prompt, rng, guide), names=[session_id])[0]


def random_blocks(engine: TargetEngine, prompt: list[int], rng: random.Random, guide: list[int]):
    """``speculate``'s next block for a session that has ``tokens``: a random chain or tree."""
    def next_block(session_id: str, tokens: list[int], block_id: int) -> DraftBlock:
        ahead = guide[len(tokens):] + [rng.randrange(engine.vocab_size) for _ in range(4)]
        if rng.random() < 0.5:
            drafts, parents = random_tree(rng, ahead, rng.randint(1, 6))
        else:
            drafts, parents = [t if rng.random() < 0.7 else rng.randrange(300) for t in ahead[: rng.randint(0, 4)]], []
        return DraftBlock(session_id, len(prompt) + len(tokens), tuple(drafts), block_id=block_id,
                          draft_parents=tuple(parents))

    return next_block


def test_each_row_allows_exactly_what_keeps_the_text_in_the_language(engine, loaded) -> None:
    eos = set(engine.info.eos_token_ids)
    texts = token_texts(loaded.tokenizer, engine.vocab_size)
    constraint = engine.grammars.constraint(REGEX, [])
    # A chain of drafts: "fishes" as the tokenizer spells it, then a token the grammar forbids.
    word = loaded.tokenizer.encode("fishes", add_special_tokens=False)
    chain = [*word, loaded.tokenizer.encode("x", add_special_tokens=False)[0]]
    masked = constraint.masked(torch.zeros(len(chain) + 1, engine.vocab_size), chain)  # [rows, vocab]
    for row in range(len(word) + 1):
        text = loaded.tokenizer.decode(word[:row])
        assert set(torch.isfinite(masked[row]).nonzero()[:, 0].tolist()) == allowed_after(text, texts, eos), row
    assert masked[len(word)].isfinite().nonzero()[:, 0].tolist() == sorted(eos)  # whole: only the end
    assert torch.isfinite(masked[len(word) + 1]).all()  # below a forbidden draft: left as is
    # The walk rolled back: the same rows again; the committed state moves with advance().
    assert torch.equal(constraint.masked(torch.zeros_like(masked), chain), masked)
    constraint.advance(word[:1])
    assert torch.equal(constraint.masked(torch.zeros(1, engine.vocab_size))[0], masked[1])


def test_greedy_output_is_a_word_of_the_language_and_speculation_keeps_it(engine, loaded) -> None:
    for n, grammar in enumerate([REGEX, Grammar(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))]):
        config = SessionConfig(max_new_tokens=48, grammar=grammar)
        prompt = prompt_ids(20 + n)
        tokens = decode(engine, prompt, config, "ar")
        text = loaded.tokenizer.decode(tokens[:-1])
        assert tokens[-1] in engine.info.eos_token_ids  # it stopped as soon as the text was whole
        if grammar is REGEX:
            assert text in LANGUAGE
        else:
            jsonschema.validate(json.loads(text), SCHEMA)
        for seed in range(3):
            assert speculate(engine, prompt, config, f"sp{seed}", random.Random(seed), tokens) == tokens


def test_the_quantized_target_masks_natively_and_speculation_keeps_its_answer(quantized_gemma) -> None:
    """The default CPU path (the GGUF's own blocks, the lean pass): the mask is applied by
    decoder_ops.cpp, and speculative sessions commit what decoding does, token for token."""
    engine = TargetEngine(quantized_gemma)
    assert engine.runner.mask_rows is not None
    config = SessionConfig(max_new_tokens=48, grammar=Grammar(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)))
    prompt = prompt_ids(60)
    tokens = decode(engine, prompt, config, "ar")
    jsonschema.validate(json.loads(quantized_gemma.tokenizer.decode(tokens[:-1])), SCHEMA)
    for seed in range(3):
        assert speculate(engine, prompt, config, f"sp{seed}", random.Random(seed), tokens) == tokens


def enumerate_texts(loaded, engine: TargetEngine, prompt: list[int], temperature: float) -> dict[str, float]:
    """The exact distribution of the sampled text: every token path through the language, each
    step's probability the model's softmax renormalised over the brute-force allowed tokens."""
    eos = set(engine.info.eos_token_ids)
    texts = token_texts(loaded.tokenizer, engine.vocab_size)
    found: dict[str, float] = {}

    @torch.inference_mode()
    def walk(tokens: list[int], text: str, p: float) -> None:
        logits = loaded.model(torch.tensor([prompt + tokens])).logits[0, -1].float() / temperature  # [vocab]
        allowed = sorted(allowed_after(text, texts, eos))
        probs = torch.softmax(logits[allowed], dim=-1).tolist()
        for token, q in zip(allowed, probs):
            if token in eos:
                found[text] = found.get(text, 0.0) + p * q
            elif p * q > 1e-7:
                walk(tokens + [token], text + texts[token], p * q)

    walk([], "", 1.0)
    return found


def test_sampled_text_follows_the_targets_renormalised_distribution_speculative_or_not(engine, loaded) -> None:
    prompt = prompt_ids(31)
    exact = enumerate_texts(loaded, engine, prompt, temperature=1.0)
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-4)
    exact = {text: p / sum(exact.values()) for text, p in exact.items()}  # (paths below 1e-7 were left out)
    rng = random.Random(0)
    configs = [SessionConfig(max_new_tokens=16, temperature=1.0, seed=seed, grammar=REGEX) for seed in range(400)]
    for how in ("decode", "speculate"):
        counts = {text: 0 for text in exact}
        steps = decode_step if how == "decode" else random_blocks(engine, prompt, rng, [])
        for tokens in run_together(engine, prompt, configs, steps):
            counts[loaded.tokenizer.decode(tokens[:-1])] += 1
        common = [text for text in exact if exact[text] * 400 >= 5]  # chi-square's rule; the rest pooled
        observed = [counts[t] for t in common] + [400 - sum(counts[t] for t in common)]
        expected = [exact[t] * 400 for t in common] + [400 - sum(exact[t] * 400 for t in common)]
        if expected[-1] < 1e-6:
            observed, expected = observed[:-1], expected[:-1]
            expected[-1] += 400 - sum(expected)  # (chisquare wants the totals equal to the bit)
        assert stats.chisquare(observed, expected).pvalue > 1e-4, (how, counts, exact)


def test_log_probabilities_stay_the_models_own(engine, loaded) -> None:
    prompt = prompt_ids(40)
    config = SessionConfig(max_new_tokens=16, grammar=REGEX, top_logprobs=2)
    first = engine.prefill("lp", prompt, config)
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([prompt])).logits[0, -1].float()  # [vocab]
    logp = torch.log_softmax(logits, dim=-1)
    assert first.logprobs.logprob == pytest.approx(float(logp[first.token_id]), abs=1e-4)
    assert first.logprobs.top_logprobs[0] == pytest.approx(float(logp.max()), abs=1e-4)  # unmasked
    engine.release("lp")


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        (Grammar(GrammarKind.JSON_SCHEMA, "{not json"), "json_schema cannot be compiled"),
        (Grammar(GrammarKind.JSON_SCHEMA, '{"type": "no such type"}'), "json_schema cannot be compiled"),
        (Grammar(GrammarKind.REGEX, "(unclosed"), "regex cannot be compiled"),
        (Grammar(GrammarKind.EBNF, "root ::= undefined_rule"), "ebnf cannot be compiled"),
    ],
)
def test_a_grammar_that_cannot_be_compiled_is_refused_and_the_engine_goes_on(engine, grammar, message) -> None:
    with pytest.raises(InvalidArgument, match=message):
        engine.prefill("bad", prompt_ids(1), SessionConfig(max_new_tokens=4, grammar=grammar))
    assert engine.store.live == 0
    assert engine.prefill("good", prompt_ids(1), SessionConfig(max_new_tokens=4, grammar=REGEX)).token_id >= 0
    engine.release("good")


def test_a_session_continued_from_an_earlier_ones_text_goes_on_where_it_stopped(engine, loaded) -> None:
    """A gateway moving a session prefills the prompt and the tokens streamed so far, and says how
    many of them the grammar has matched: the new session ends as the old one would have."""
    prompt = prompt_ids(50)
    schema = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))
    whole = decode(engine, prompt, SessionConfig(max_new_tokens=48, grammar=schema), "first")
    for cut in (1, len(whole) // 2, len(whole) - 1):
        moved = SessionConfig(max_new_tokens=48, grammar=schema, continued_tokens=cut)
        rest = decode(engine, prompt + whole[:cut], moved, "moved")
        assert whole[:cut] + rest == whole
    wrong = SessionConfig(max_new_tokens=4, grammar=schema, continued_tokens=3)  # the prompt's own tokens: no JSON
    with pytest.raises(InvalidArgument, match="not text the grammar allows"):
        engine.prefill("x", prompt, wrong)
    with pytest.raises(InvalidArgument, match="continued_tokens must be in"):
        engine.prefill("x", prompt, SessionConfig(max_new_tokens=4, grammar=schema, continued_tokens=len(prompt)))


def test_a_constrained_session_cannot_ignore_eos_nor_bring_a_spec_too_long_to_compile(engine) -> None:
    with pytest.raises(InvalidArgument, match="ignore_eos"):
        engine.prefill("x", prompt_ids(1), SessionConfig(max_new_tokens=4, ignore_eos=True, grammar=REGEX))
    with pytest.raises(InvalidArgument, match="more than the 65536"):
        engine.prefill("x", prompt_ids(1),
                       SessionConfig(max_new_tokens=4, grammar=Grammar(GrammarKind.REGEX, "a" * 70000)))


def test_grammars_cross_the_wire_and_unknown_kinds_are_refused() -> None:
    params = SessionParams(SamplingParams(), max_new_tokens=4, grammar=REGEX)
    message = codecs.session_params_to_wire(params)
    assert codecs.session_params(message) == params
    assert wire.session_config(message, False).grammar == REGEX
    message.grammar.kind = 99
    with pytest.raises(InvalidArgument, match="grammar kind 99"):
        wire.session_config(message, False)
    message.grammar.kind = 0
    with pytest.raises(InvalidArgument, match="grammar kind 0"):
        wire.session_config(message, False)

"""The validation table shared by HTTP and gRPC: every bad input gets a clear InvalidRequest."""

from __future__ import annotations

import math

import pytest

from gateway.chat_template import ChatMessage
from gateway.errors import InvalidRequest
from gateway.request import Smoothing, Speculation
from gateway.served_model import ServedModel
from gateway.validation import COMPLETIONS_DEFAULT_MAX_TOKENS, RequestFields, RequestValidator

CONTEXT = 64
CHAT_DEFAULT = 32


@pytest.fixture
def validator(tokenizer):
    return RequestValidator(ServedModel("tiny", tokenizer, CONTEXT), default_chat_max_tokens=CHAT_DEFAULT)


def prompt(**overrides):
    return RequestFields(prompt="hello", **overrides)


BAD = [
    ("empty prompt", RequestFields(prompt=""), "prompt", "empty"),
    ("empty token prompt", RequestFields(prompt=[]), "prompt", "empty"),
    ("empty messages", RequestFields(messages=[]), "messages", "empty"),
    ("no prompt at all", RequestFields(), "prompt", "exactly one"),
    ("prompt and messages", RequestFields(prompt="x", messages=[ChatMessage("user", "x")]), "prompt", "exactly one"),
    ("prompt longer than context", RequestFields(prompt=[5] * CONTEXT), "prompt", "context length"),
    ("max_tokens 0", prompt(max_tokens=0), "max_tokens", "at least 1"),
    ("max_tokens negative", prompt(max_tokens=-3), "max_tokens", "at least 1"),
    ("max_tokens absurd", prompt(max_tokens=10**9), "max_tokens", "context length"),
    ("prompt + max_tokens over context", RequestFields(prompt=[5] * 40, max_tokens=30), "max_tokens", "context length"),
    ("temperature negative", prompt(temperature=-1.0), "temperature", "between 0 and 2"),
    ("temperature NaN", prompt(temperature=math.nan), "temperature", "between 0 and 2"),
    ("temperature inf", prompt(temperature=math.inf), "temperature", "between 0 and 2"),
    ("temperature above 2", prompt(temperature=2.5), "temperature", "between 0 and 2"),
    ("top_p 0", prompt(top_p=0.0), "top_p", "(0, 1]"),
    ("top_p 2", prompt(top_p=2.0), "top_p", "(0, 1]"),
    ("top_p NaN", prompt(top_p=math.nan), "top_p", "(0, 1]"),
    ("top_k negative", prompt(top_k=-1), "top_k", ">= 0"),
    ("min_p above 1", prompt(min_p=1.01), "min_p", "[0, 1]"),
    ("min_p NaN", prompt(min_p=math.nan), "min_p", "[0, 1]"),
    ("typical_p 0", prompt(typical_p=0.0), "typical_p", "(0, 1]"),
    ("typical_p above 1", prompt(typical_p=1.5), "typical_p", "(0, 1]"),
    ("typical_p NaN", prompt(typical_p=math.nan), "typical_p", "(0, 1]"),
    ("n 0", prompt(n=0), "n", "n must be between 1 and 16"),
    ("n 17", prompt(n=17), "n", "n must be between 1 and 16"),
    ("seed negative", prompt(seed=-1), "seed", "seed"),
    ("unknown model", prompt(model="no-such-model"), "model", "does not exist"),
    ("speculation invalid", prompt(speculation="sometimes"), "speculation", "'auto', 'on', 'off'"),
    ("num_speculative_tokens 0", prompt(num_speculative_tokens=0), "num_speculative_tokens", "between 1 and 64"),
    ("num_speculative_tokens 65", prompt(num_speculative_tokens=65), "num_speculative_tokens", "between 1 and 64"),
    ("empty stop string", prompt(stop=("",)), "stop", "empty"),
    ("stream_smoothing invalid", prompt(stream_smoothing="smooth"), "stream_smoothing", "'off', 'auto'"),
    ("out-of-vocabulary token id", RequestFields(prompt=[1, 2, 300]), "prompt", "outside the vocabulary"),
    ("negative token id", RequestFields(prompt=[-1]), "prompt", "outside the vocabulary"),
    ("batch of prompts", RequestFields(prompt=["a", "b"]), "prompt", "validate each (prompt_batch)"),
    ("unknown chat role", RequestFields(messages=[ChatMessage("wizard", "hi")]), "messages[0].role", "role"),
]


@pytest.mark.parametrize(("fields", "param", "phrase"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_refused_with_a_message_naming_the_field(validator, fields, param, phrase):
    with pytest.raises(InvalidRequest) as info:
        validator.validate(fields)
    assert info.value.param == param
    assert phrase in info.value.message
    assert info.value.http_status == (404 if param == "model" else 400)  # an unknown model: not found


def test_unknown_model_has_openai_code(validator):
    with pytest.raises(InvalidRequest) as info:
        validator.validate(prompt(model="gpt-4"))
    assert info.value.code == "model_not_found" and info.value.http_status == 404


def test_defaults(validator):
    request = validator.validate(prompt())
    assert request.max_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS
    assert (request.sampling.temperature, request.sampling.top_p, request.sampling.top_k) == (1.0, 1.0, 0)
    assert request.sampling.min_p == 0.0
    assert request.speculation is Speculation.AUTO and request.num_speculative_tokens is None
    assert request.stop == () and request.stop_token_ids == ()


def test_chat_defaults_to_the_setting_and_adds_the_fallback_stop(validator):
    request = validator.validate(RequestFields(messages=[ChatMessage("user", "hi")], stop=("END",)))
    assert request.max_tokens == CHAT_DEFAULT
    assert request.stop == ("END", "\nUser:")


def test_default_max_tokens_is_capped_by_the_remaining_context(validator):
    request = validator.validate(RequestFields(prompt=[5] * (CONTEXT - 3)))
    assert request.max_tokens == 3


def test_token_prompts_in_every_accepted_shape(validator, tokenizer):
    ids = tokenizer("hello", add_special_tokens=True)["input_ids"]
    for shape in ("hello", ["hello"], ids, [ids]):
        assert validator.validate(RequestFields(prompt=shape)).prompt_token_ids == tuple(ids)


def test_valid_extremes_are_accepted(validator):
    request = validator.validate(
        RequestFields(prompt=[5], temperature=0.0, top_p=1.0, top_k=10**400, seed=2**64 - 1, num_speculative_tokens=64,
                      speculation="off", max_tokens=CONTEXT - 1, n=1, model="tiny", min_p=1.0, typical_p=1e-9)
    )
    assert request.sampling.min_p == 1.0 and request.sampling.typical_p == 1e-9
    assert request.sampling.top_k == len(validator._model.tokenizer)  # clamped: no truncation
    assert request.speculation is Speculation.OFF and request.max_tokens == CONTEXT - 1


def test_stream_smoothing_override(validator):
    assert validator.validate(prompt()).stream_smoothing is None  # the gateway's default
    assert validator.validate(prompt(stream_smoothing="off")).stream_smoothing is Smoothing.OFF
    assert validator.validate(prompt(stream_smoothing="auto")).stream_smoothing is Smoothing.AUTO

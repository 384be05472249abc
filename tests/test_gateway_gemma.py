"""The gateway's text handling with the real default model's tokenizer (gemma-3-270m).

Gemma's tokenizer differs from the tiny byte-level one: SentencePiece pieces with byte fallback,
no chat template, and an ``<end_of_turn>`` token. The first test run converts the GGUF into the
tandem cache (about a minute, once); later runs load it in seconds.
"""

from __future__ import annotations

import pytest

from gateway.chat_template import ChatFormat, ChatMessage
from gateway.detokenizer import IncrementalDetokenizer
from tandem.models import load_tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma_tokenizer(gemma_spec):
    return load_tokenizer(gemma_spec)


def test_detokenizer_with_byte_fallback_pieces(gemma_tokenizer):
    text = "Hello wörld ✓ 日本語 🙂\n  indented café 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"
    ids = gemma_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert any(gemma_tokenizer.decode([i]) == "\ufffd" for i in ids)  # byte-fallback pieces
    for context in ((), gemma_tokenizer("Say:", add_special_tokens=True)["input_ids"]):
        detok = IncrementalDetokenizer(gemma_tokenizer, context_ids=context)
        deltas = [detok.push(i) for i in ids]
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) + detok.flush() == text


def test_fallback_template_and_end_of_turn_stop(gemma_tokenizer):
    chat = ChatFormat.for_tokenizer(gemma_tokenizer)
    assert chat.uses_fallback
    assert chat.stop_token_ids == (gemma_tokenizer.convert_tokens_to_ids("<end_of_turn>"),)
    ids = chat.token_ids([ChatMessage("user", "Say hello.")])
    assert ids[0] == gemma_tokenizer.bos_token_id and ids.count(gemma_tokenizer.bos_token_id) == 1
    assert gemma_tokenizer.decode(ids[1:]) == "User: Say hello.\n\nAssistant:"

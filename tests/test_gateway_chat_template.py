"""Chat formatting: the tokenizer's own template, or the documented plain fallback; a template given at
start-up (``--chat-template``) in place of either."""

from __future__ import annotations

import httpx
import pytest

from gateway.chat_template import (
    FALLBACK_STOP_STRINGS,
    ChatFormat,
    ChatMessage,
    ChatTemplateError,
    end_of_turn_ids,
    load_template,
)
from gateway_fakes import fake_stack

MESSAGES = [ChatMessage("system", "You are terse."), ChatMessage("user", "Say hello.")]


def test_model_without_template_gets_the_plain_fallback(tokenizer):
    assert not tokenizer.chat_template
    chat = ChatFormat.for_tokenizer(tokenizer)
    assert chat.uses_fallback
    assert chat.render(MESSAGES) == "<bos>System: You are terse.\n\nUser: Say hello.\n\nAssistant:"
    assert chat.stop_strings == FALLBACK_STOP_STRINGS


def test_fallback_prompt_starts_with_bos_once(tokenizer):
    ids = ChatFormat.for_tokenizer(tokenizer).token_ids(MESSAGES)
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids, skip_special_tokens=True).endswith("Assistant:")


def test_tokenizer_template_is_used_when_present(tokenizer):
    own = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    templated = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    templated.chat_template = own
    chat = ChatFormat.for_tokenizer(templated)
    assert not chat.uses_fallback and chat.stop_strings == ()
    assert chat.render(MESSAGES) == "<system>You are terse.<user>Say hello.<assistant>"


def test_template_errors_become_chat_template_errors(tokenizer):
    templated = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    templated.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ChatFormat.for_tokenizer(templated).render(MESSAGES)


def test_end_of_turn_token_becomes_a_stop_token(tokenizer):
    assert ChatFormat.for_tokenizer(tokenizer).stop_token_ids == ()
    with_eot = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    with_eot.add_special_tokens({"additional_special_tokens": ["<end_of_turn>"]})
    assert ChatFormat.for_tokenizer(with_eot).stop_token_ids == (with_eot.convert_tokens_to_ids("<end_of_turn>"),)


def test_end_of_turn_ids_of_a_tokenizer_without_a_tokenizers_backend():
    class Plain:  # a slow tokenizer: its vocabulary only as a dict
        def get_vocab(self) -> dict[str, int]:
            return {"a": 1, "<|im_end|>": 7, "<end_of_turn>": 9}

    assert end_of_turn_ids(Plain()) == (9, 7)


OWN = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
       "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_a_template_given_at_start_up_replaces_the_tokenizers_or_the_fallback(tokenizer, tmp_path):
    assert load_template(OWN) == OWN
    (tmp_path / "chat.jinja").write_text(OWN)
    assert load_template(str(tmp_path / "chat.jinja")) == OWN
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_template(str(tmp_path / "missing.jinja"))
    chat = ChatFormat.for_tokenizer(tokenizer, OWN)  # a tokenizer without a template of its own
    assert not chat.uses_fallback and chat.stop_strings == ()
    assert chat.render(MESSAGES) == "<system>You are terse.<user>Say hello.<assistant>"
    templated = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    templated.chat_template = "{{ 'never used' }}"
    assert ChatFormat.for_tokenizer(templated, OWN).render(MESSAGES) == chat.render(MESSAGES)


async def test_a_gateway_renders_chat_with_the_given_template_and_refuses_a_broken_one(tokenizer, tiny_dir):
    async with fake_stack(tokenizer, str(tiny_dir), chat_template=OWN) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as client:
            answer = await client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
            assert answer.status_code == 200
            assert tokenizer.decode(answer.json()["tokens"]) == "<user>hi<assistant>"
    for broken, message in (("{% for m in messages %}", "--chat-template: "),
                            ("{{ raise_exception('no user turns here') }}", "no user turns here"),
                            ("chat.jinja", "neither a file nor a Jinja template")):
        with pytest.raises(SystemExit, match=message):
            async with fake_stack(tokenizer, str(tiny_dir), chat_template=broken):
                pass

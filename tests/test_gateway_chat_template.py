"""Chat formatting: the tokenizer's own template, or the documented plain fallback; a template given at
start-up (``--chat-template``) in place of either; a request's template controls (``add_generation_prompt``,
``continue_final_message``, ``chat_template_kwargs``) over HTTP and gRPC."""

from __future__ import annotations

import grpc
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
from gateway.template_options import TemplateOptions
from gateway_fakes import fake_stack
from tandem.v1 import gateway_pb2, gateway_pb2_grpc

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


THINKING = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% if not enable_thinking %}<no-think>{% endif %}{% endif %}")
PARTIAL = [ChatMessage("user", "Name a colour."), ChatMessage("assistant", "The colour is")]


def test_a_request_shapes_the_rendering(tokenizer):
    chat = ChatFormat.for_tokenizer(tokenizer, THINKING)
    assert chat.render(MESSAGES[1:]) == "<user>Say hello.</user><assistant><no-think>"
    assert chat.render(MESSAGES[1:], TemplateOptions(kwargs={"enable_thinking": True})) == \
        "<user>Say hello.</user><assistant>"
    assert chat.render(MESSAGES[1:], TemplateOptions(add_generation_prompt=False)) == "<user>Say hello.</user>"
    continued = TemplateOptions(add_generation_prompt=False, continue_final_message=True)
    assert chat.render(PARTIAL, continued) == "<user>Name a colour.</user><assistant>The colour is"
    fallback = ChatFormat.for_tokenizer(tokenizer)  # the plain transcript: the assistant's paragraph left open
    assert fallback.render(PARTIAL, continued) == "<bos>User: Name a colour.\n\nAssistant: The colour is"
    assert {"messages", "tools", "tokenize", "bos_token", "add_generation_prompt"} <= chat.reserved_names


async def test_chat_requests_continue_a_message_and_set_template_variables(tokenizer, tiny_dir):
    user = {"role": "user", "content": "Name a colour."}
    partial = [user, {"role": "assistant", "content": "The colour is"}]
    continued = {"add_generation_prompt": False, "continue_final_message": True}
    async with fake_stack(tokenizer, str(tiny_dir), chat_template=THINKING) as stack:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=10) as client:
            async def chat(**body):
                return await client.post("/v1/chat/completions", json={"max_tokens": 3, **body})

            answer = await chat(messages=partial, **continued)
            assert answer.status_code == 200, answer.text
            assert tokenizer.decode(stack.model.prefilled_prompts[-1]) == \
                "<user>Name a colour.</user><assistant>The colour is"
            tokens = await client.post("/tokenize", json={"messages": partial, **continued})
            assert tokens.json()["tokens"] == list(stack.model.prefilled_prompts[-1])  # /tokenize agrees
            assert (await chat(messages=[user], chat_template_kwargs={"enable_thinking": True})).status_code == 200
            assert tokenizer.decode(stack.model.prefilled_prompts[-1]) == "<user>Name a colour.</user><assistant>"
            assert (await chat(messages=[user])).status_code == 200
            assert tokenizer.decode(stack.model.prefilled_prompts[-1]).endswith("<assistant><no-think>")

            refusals = [
                ({"messages": partial, "continue_final_message": True}, "continue_final_message",
                 "needs add_generation_prompt: false"),
                ({"messages": [user], **continued}, "continue_final_message", "the last message is the user's"),
                ({"messages": partial, **continued, "response_format": {"type": "json_object"}}, "response_format",
                 "cannot be combined"),
                ({"messages": partial, **continued, "guided_regex": "a+"}, "guided_regex", "cannot be combined"),
                ({"messages": [user], "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs",
                 "cannot set 'tokenize'"),
                ({"messages": [user], "chat_template_kwargs": {"bos_token": "x", "messages": []}},
                 "chat_template_kwargs", "cannot set 'bos_token', 'messages'"),
                ({"messages": [user], "chat_template_kwargs": {"x": "y" * 70000}}, "chat_template_kwargs",
                 "at most 65536"),
                ({"messages": [user], "chat_template_kwargs": ["enable_thinking"]}, None, "chat_template_kwargs"),
            ]
            for body, param, message in refusals:
                answer = await chat(**body)
                assert answer.status_code == 400, body
                error = answer.json()["error"]
                assert error["param"] == param or param is None, error
                assert message in error["message"], error
            completion = await client.post("/v1/completions", json={"prompt": "hi", "chat_template_kwargs": {"a": 1}})
            assert completion.status_code == 400 and completion.json()["error"]["param"] == "chat_template_kwargs"
            assert (await chat(messages=[user])).status_code == 200  # still serving

        async with grpc.aio.insecure_channel(stack.grpc_address) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            request = gateway_pb2.GatewayServiceGenerateRequest(
                messages=[gateway_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in partial],
                max_tokens=2, add_generation_prompt=False, continue_final_message=True,
            )
            request.chat_template_kwargs.update({"enable_thinking": True})
            async for _ in stub.Generate(request):
                pass
            assert tokenizer.decode(stack.model.prefilled_prompts[-1]) == \
                "<user>Name a colour.</user><assistant>The colour is"
            request = gateway_pb2.GatewayServiceGenerateRequest(prompt="hi", max_tokens=2, continue_final_message=True)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in stub.Generate(request):
                    pass
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "a prompt takes none of them" in refused.value.details()

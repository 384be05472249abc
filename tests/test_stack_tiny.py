"""Whole stack, real processes: ``tandem serve`` with tiny random models on free ports.

The target and the draft have different random weights (low acceptance, many rejections), so
rollback and recovered tokens are exercised on every round.
"""

from __future__ import annotations

import json
import re
import time

import grpc
import httpx
import jsonschema
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from gateway.token_masks import bad_word_sequences
from stack import metric_value, running_stack
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

PROMPTS = ["def fibonacci(n):", "The quick brown fox", '{"name": "tandem", "items": ['] 


@pytest.fixture(scope="module")
def stack(tiny_dir, tiny_draft_dir):
    with running_stack(str(tiny_dir), str(tiny_draft_dir), k=4) as running:
        yield running


@pytest.fixture(scope="module")
def reference(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()

    def greedy(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
        return out[0, len(prompt_ids):].tolist()

    return tokenizer, greedy


def grpc_generate(stack, **fields) -> tuple[list[int], str, list]:
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        chunks = list(stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(**fields), timeout=120))
    ids = [t for c in chunks for t in c.token_ids]
    return ids, "".join(c.text for c in chunks), chunks


@pytest.mark.parametrize("speculation", [common_pb2.SPECULATION_MODE_ON, common_pb2.SPECULATION_MODE_OFF])
def test_grpc_greedy_equals_target_generate(stack, reference, speculation) -> None:
    tokenizer, greedy = reference
    for prompt in PROMPTS:
        prompt_ids = tokenizer(prompt).input_ids
        expected = greedy(prompt_ids, 40)
        ids, text, chunks = grpc_generate(
            stack, prompt_token_ids=prompt_ids, max_tokens=40, temperature=0.0, speculation=speculation
        )
        assert ids == expected, prompt
        usage = chunks[-1].usage
        assert usage.completion_tokens == len(expected)
        if speculation == common_pb2.SPECULATION_MODE_ON:
            assert usage.speculative_decoding.rounds > 0
            assert usage.speculative_decoding.mode == "speculative"
        else:
            assert usage.speculative_decoding.mode == "autoregressive"


def test_openai_sdk_stream_and_non_stream(stack, reference) -> None:
    tokenizer, greedy = reference
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    prompt = PROMPTS[0]
    expected_text = tokenizer.decode(greedy(tokenizer(prompt).input_ids, 24), skip_special_tokens=True)

    done = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0)
    assert done.choices[0].text == expected_text
    spec = done.usage.model_extra["speculative_decoding"]
    assert spec["rounds"] > 0 and 0.0 <= spec["acceptance_rate"] <= 1.0

    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected_text
    assert chunks[-1].usage.completion_tokens == 24 or chunks[-1].usage.completion_tokens <= 24

    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0, stream=True,
        extra_body={"speculation": "on", "num_speculative_tokens": 3},
    )
    pieces = list(chat)
    assert any(p.choices and p.choices[0].finish_reason for p in pieces)


def test_logprobs_are_the_targets_whether_speculating_or_not(stack, reference, tiny_dir) -> None:
    """The OpenAI SDK's completions ``logprobs``: through draft and target (``on``) and the target's
    Generate (``off``), each token's value is the target model's own log-softmax at its position."""
    tokenizer, greedy = reference
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
    prompt_ids = tokenizer(PROMPTS[1]).input_ids
    expected = greedy(prompt_ids, 20)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids + expected])).logits[0, len(prompt_ids) - 1 : -1]  # [20, vocab]
    want = torch.log_softmax(logits.float(), dim=-1)
    for speculation in ("on", "off"):
        done = client.completions.create(model=client.models.list().data[0].id, prompt=prompt_ids, max_tokens=20,
                                         temperature=0, logprobs=2, extra_body={"speculation": speculation})
        logprobs = done.choices[0].logprobs
        assert done.usage.model_extra["speculative_decoding"]["mode"] == ("speculative" if speculation == "on"
                                                                          else "autoregressive")
        assert logprobs.token_logprobs == pytest.approx([float(want[i, t]) for i, t in enumerate(expected)], abs=1e-4)
        assert [sorted(top.values(), reverse=True)[0] for top in logprobs.top_logprobs] == pytest.approx(
            want.max(dim=-1).values.tolist(), abs=1e-4)


def test_echo_scores_a_prompt_as_the_target_model_does(stack, reference, tiny_dir) -> None:
    """lm-evaluation-harness's loglikelihood request (token ids, echo, logprobs 1, one token): each
    prompt token's value is the target model's log-softmax at its position, across the stack."""
    tokenizer, _ = reference
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    prompt = tokenizer(PROMPTS[0] * 4).input_ids
    body = {"model": "", "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    done = httpx.post(f"{stack.base_url}/v1/completions", json=body, timeout=60).json()
    logprobs = done["choices"][0]["logprobs"]
    with torch.inference_mode():
        want = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)  # [len, vocab]
    expected = [float(want[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    assert logprobs["token_logprobs"][0] is None
    assert logprobs["token_logprobs"][1 : len(prompt)] == pytest.approx(expected, abs=1e-4)
    assert [max(top.values()) for top in logprobs["top_logprobs"][1 : len(prompt)]] == pytest.approx(
        want[: len(prompt) - 1].max(dim=-1).values.tolist(), abs=1e-4)


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": [
    "a", "b"]}, "maxItems": 3}}, "required": ["ok", "tags"], "additionalProperties": False}


def test_structured_output_follows_the_schema_and_speculation_keeps_the_answer(stack) -> None:
    """OpenAI's json_schema response_format through draft and target (``on``) and the target alone
    (``off``): the same JSON, valid under the schema; gRPC's grammar the same; a schema the target
    cannot compile is a 400 naming response_format, and the stack goes on."""
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
    answers = {}
    for speculation in ("on", "off"):
        done = client.chat.completions.create(
            model="", messages=[{"role": "user", "content": "Give me JSON"}], max_tokens=60, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}},
            extra_body={"speculation": speculation})
        answers[speculation] = done.choices[0].message.content
        assert done.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(answers[speculation]), SCHEMA)
    assert answers["on"] == answers["off"]
    grammar = common_pb2.Grammar(kind=common_pb2.GRAMMAR_KIND_REGEX, spec="(yes|no), [0-9]{2}")
    _, text, chunks = grpc_generate(stack, prompt="Answer:", max_tokens=20, temperature=0.8, seed=3, grammar=grammar)
    assert re.fullmatch("(yes|no), [0-9]{2}", text) and chunks[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    bad = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "regex", "regex": "(open"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format", bad.text
    assert "regex cannot be compiled" in bad.json()["error"]["message"]
    # Any object: a random model may still be inside a string when its tokens run out.
    again = client.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}], max_tokens=30,
                                           response_format={"type": "json_object"})
    assert again.choices[0].message.content.startswith("{")
    if again.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(again.choices[0].message.content), dict)


def test_penalties_change_the_answer_and_speculation_keeps_it(stack) -> None:
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
    answers = {}
    for speculation in ("on", "off"):
        for penalty in (0.0, 1.5):
            done = client.completions.create(model="", prompt=PROMPTS[1], max_tokens=40, temperature=0,
                                             frequency_penalty=penalty, presence_penalty=penalty / 2,
                                             extra_body={"speculation": speculation, "ignore_eos": True,
                                                         "repetition_penalty": 1 + penalty / 3})
            answers[speculation, penalty] = done.choices[0].text
    assert answers["on", 1.5] == answers["off", 1.5] and answers["on", 0.0] == answers["off", 0.0]
    assert answers["off", 1.5] != answers["off", 0.0]


def test_other_servers_structured_output_fields_are_kept_through_speculation(stack) -> None:
    """vLLM's guided_choice and structured_outputs, llama.cpp's json_schema: the answer follows them,
    the same speculating or not."""
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
    asks = [({"guided_choice": ["yes", "no", "maybe so"]}, lambda text: text in ("yes", "no", "maybe so")),
            ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, lambda text: re.fullmatch("[0-9]{3}-[a-z]{2}", text)),
            ({"json_schema": {"enum": ["red", "green", 7]}}, lambda text: json.loads(text) in ("red", "green", 7))]
    for body, follows in asks:
        texts = set()
        for speculation in ("on", "off"):
            done = client.completions.create(model="", prompt=PROMPTS[1], max_tokens=40, temperature=0,
                                             extra_body={**body, "speculation": speculation})
            assert done.choices[0].finish_reason == "stop" and follows(done.choices[0].text), (body, done)
            texts.add(done.choices[0].text)
        assert len(texts) == 1, texts
    bad = httpx.post(f"{stack.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 4, "guided_regex": "[a-"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_regex", bad.text
    assert "cannot be compiled" in bad.json()["error"]["message"]


def test_min_p_reaches_the_target_through_speculation(stack) -> None:
    """min_p 1 keeps only each step's most probable token, so a sampled request is the greedy answer,
    speculating or not (the draft samples its proposals; the target verifies them against the cut)."""
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
    greedy = client.completions.create(model="", prompt=PROMPTS[2], max_tokens=40, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    for speculation in ("on", "off"):
        done = client.completions.create(model="", prompt=PROMPTS[2], max_tokens=40, temperature=0.8, seed=5,
                                         extra_body={"speculation": speculation, "ignore_eos": True, "min_p": 1})
        assert done.choices[0].text == greedy, speculation
        mode = done.usage.model_extra["speculative_decoding"]["mode"]
        assert mode == ("speculative" if speculation == "on" else "autoregressive"), mode


def test_typical_p_reaches_the_target_through_speculation(stack) -> None:
    """A near-zero typical_p keeps each step's one token nearest the entropy, so a sampled request is
    deterministic, speculating or not, whatever its seed, and not the greedy answer."""
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
    greedy = client.completions.create(model="", prompt=PROMPTS[2], max_tokens=40, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    texts = set()
    for speculation, seed in (("on", 5), ("off", 6), ("on", 7)):
        done = client.completions.create(model="", prompt=PROMPTS[2], max_tokens=40, temperature=0.8, seed=seed,
                                         extra_body={"speculation": speculation, "ignore_eos": True,
                                                     "typical_p": 1e-9})
        texts.add(done.choices[0].text)
        mode = done.usage.model_extra["speculative_decoding"]["mode"]
        assert mode == ("speculative" if speculation == "on" else "autoregressive"), mode
    assert len(texts) == 1 and texts != {greedy}, texts


def test_bad_words_are_never_spelled_and_speculation_keeps_the_answer(stack, reference) -> None:
    """A word of the greedy answer, banned: the answer (gRPC's token ids, HTTP's text) never spells it
    as the gateway tokenizes it, and is the same speculating or not."""
    tokenizer, _ = reference
    ids, text, _ = grpc_generate(stack, prompt=PROMPTS[1], max_tokens=40, temperature=0,
                                 speculation=common_pb2.SPECULATION_MODE_OFF, ignore_eos=True)

    def spells(tokens: list[int], sequence: tuple[int, ...]) -> bool:
        return any(tuple(tokens[i:i + len(sequence)]) == sequence for i in range(len(tokens)))

    word = next(w for w in text.split() if any(spells(ids, s) for s in bad_word_sequences([w], tokenizer)))
    banned = bad_word_sequences([word], tokenizer)
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
    answers = {}
    for speculation in ("on", "off"):
        done, _, _ = grpc_generate(stack, prompt=PROMPTS[1], max_tokens=40, temperature=0, bad_words=[word],
                                   speculation=getattr(common_pb2, f"SPECULATION_MODE_{speculation.upper()}"),
                                   ignore_eos=True)
        assert len(done) == 40 and not any(spells(done, s) for s in banned), (word, done)
        over_http = client.completions.create(model="", prompt=PROMPTS[1], max_tokens=40, temperature=0,
                                              extra_body={"speculation": speculation, "ignore_eos": True,
                                                          "bad_words": [word]})
        answers[speculation] = (done, over_http.choices[0].text)
    assert answers["on"] == answers["off"] and answers["on"][0] != ids


def test_allowed_token_ids_make_the_whole_answer_speculating_or_not(stack) -> None:
    """Every token of the answer is one of allowed_token_ids (not the end-of-sequence token: the
    answer runs to max_tokens), over gRPC and HTTP alike, and the answer is the same speculating or not."""
    ids, _, _ = grpc_generate(stack, prompt=PROMPTS[0], max_tokens=30, temperature=0,
                              speculation=common_pb2.SPECULATION_MODE_OFF, ignore_eos=True)
    allowed = sorted(set(ids[1::3]) | {17, 40})
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
    answers = {}
    for speculation in ("on", "off"):
        done, _, chunks = grpc_generate(stack, prompt=PROMPTS[0], max_tokens=30, temperature=0,
                                        allowed_token_ids=allowed, ignore_eos=False,
                                        speculation=getattr(common_pb2, f"SPECULATION_MODE_{speculation.upper()}"))
        assert len(done) == 30 and set(done) <= set(allowed), done
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        over_http = client.completions.create(model="", prompt=PROMPTS[0], max_tokens=30, temperature=0,
                                              extra_body={"speculation": speculation, "allowed_token_ids": allowed})
        answers[speculation] = (done, over_http.choices[0].text)
    assert answers["on"] == answers["off"] and answers["on"][0] != ids


def test_logit_bias_bans_tokens_and_speculation_keeps_the_answer(stack) -> None:
    """Tokens banned with -100 never appear; the biased answer is the same speculating or not, over
    HTTP (the OpenAI SDK) and gRPC."""
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
    ids, _, _ = grpc_generate(stack, prompt=PROMPTS[0], max_tokens=40, temperature=0,
                              speculation=common_pb2.SPECULATION_MODE_OFF, ignore_eos=True)
    banned = {token: -100.0 for token in ids[:6]}
    answers, over_grpc = {}, {}
    for speculation in ("on", "off"):
        done = client.completions.create(model="", prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                         logit_bias={str(t): b for t, b in banned.items()},
                                         extra_body={"speculation": speculation, "ignore_eos": True})
        answers[speculation] = done.choices[0].text
        biased, _, _ = grpc_generate(stack, prompt=PROMPTS[0], max_tokens=40, temperature=0, logit_bias=banned,
                                     speculation=getattr(common_pb2, f"SPECULATION_MODE_{speculation.upper()}"),
                                     ignore_eos=True)
        assert not set(biased) & set(banned) and len(biased) == 40
        over_grpc[speculation] = biased
    assert answers["on"] == answers["off"] and over_grpc["on"] == over_grpc["off"]


def test_stop_token_ids_and_min_tokens_end_the_answer_alike_speculating_or_not(stack) -> None:
    """A stop token id ends the greedy answer where it first appears (its text left out); with
    min_tokens it cannot appear in the first tokens, which changes the answer the same way
    speculating or not."""
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
    ids, _, _ = grpc_generate(stack, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                              speculation=common_pb2.SPECULATION_MODE_OFF, ignore_eos=True)
    stop = ids[2]
    first = ids.index(stop)
    answers = {}
    for speculation in ("on", "off"):
        for floor in (0, first + 2):
            done = client.completions.create(model="", prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                             extra_body={"speculation": speculation, "ignore_eos": True,
                                                         "stop_token_ids": [stop], "min_tokens": floor})
            answers[speculation, floor] = (done.choices[0].text, done.usage.completion_tokens)
    assert answers["on", 0] == answers["off", 0]
    assert answers["off", 0][1] == first + 1  # the stop token counts
    assert answers["on", first + 2] == answers["off", first + 2] != answers["off", 0]
    assert answers["off", first + 2][1] > first + 2


SETTINGS = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}, "loud": {"type": "boolean"}},
            "required": ["unit", "loud"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "set_units", "parameters": SETTINGS}},
         {"type": "function", "function": {"name": "reset"}}]


def test_tool_calls_are_valid_whole_and_streamed_and_speculation_keeps_them(stack) -> None:
    """The target's grammar makes every call valid, on a random model too; the speculative and the
    autoregressive calls are the same, and the streamed call is the whole one."""
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
    messages = [{"role": "user", "content": PROMPTS[1]}]
    named = {"type": "function", "function": {"name": "set_units"}}
    answers = {}
    for speculation in ("on", "off"):
        for choice in ("required", named):
            done = client.chat.completions.create(model="", messages=messages, tools=TOOLS, tool_choice=choice,
                                                  parallel_tool_calls=False, max_tokens=60, temperature=0,
                                                  extra_body={"speculation": speculation})
            calls = [(c.function.name, json.loads(c.function.arguments)) for c in done.choices[0].message.tool_calls]
            assert len(calls) == 1 and done.choices[0].finish_reason == ("stop" if choice is named else "tool_calls")
            name, arguments = calls[0]
            if name == "set_units":
                jsonschema.validate(arguments, SETTINGS)
            else:
                assert (name, arguments) == ("reset", {}) and choice == "required"
            answers[speculation, str(choice)] = calls
    for choice in ("required", str(named)):
        assert answers["on", choice] == answers["off", choice]
    streamed = client.chat.completions.create(model="", messages=messages, tools=TOOLS, tool_choice=named,
                                              max_tokens=60, temperature=0, stream=True)
    parts = [c.choices[0].delta.tool_calls[0] for c in streamed if c.choices and c.choices[0].delta.tool_calls]
    assert json.loads("".join(p.function.arguments for p in parts)) == answers["on", str(named)][0][1]
    # "auto" (no tool_choice): the model calls or answers in text, and either way speculation agrees.
    for prompt in PROMPTS:
        auto = {}
        for speculation in ("on", "off"):
            done = client.chat.completions.create(model="", messages=[{"role": "user", "content": prompt}],
                                                  tools=TOOLS, max_tokens=40, temperature=0,
                                                  extra_body={"speculation": speculation})
            message, reason = done.choices[0].message, done.choices[0].finish_reason
            if message.tool_calls:
                assert reason == "tool_calls" and message.content is None
                for call in message.tool_calls:
                    jsonschema.validate(json.loads(call.function.arguments), SETTINGS if call.function.name ==
                                        "set_units" else {"type": "object"})
            else:
                assert not message.content.lstrip().startswith("[") and reason in ("stop", "length")
            auto[speculation] = (message.content, [(c.function.name, c.function.arguments)
                                                   for c in message.tool_calls or ()])
        assert auto["on"] == auto["off"]
    # The next turn: the call and its result in the history, as an agent loop sends them.
    call_id = "call_abc"
    history = messages + [{"role": "assistant", "tool_calls": [{"id": call_id, "type": "function", "function": {
        "name": "set_units", "arguments": json.dumps(answers["on", str(named)][0][1])}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "done"}]
    after = client.chat.completions.create(model="", messages=history, max_tokens=8, temperature=0)
    assert after.choices[0].message.tool_calls is None and after.choices[0].message.content is not None


def test_the_responses_api_answers_as_chat_does_speculating_or_not(stack) -> None:
    """``/v1/responses`` through the OpenAI SDK: the same text as the chat route for the same
    conversation, a valid structured answer and tool call, speculative and autoregressive alike."""
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
    chat = client.chat.completions.create(model="", messages=[{"role": "system", "content": "Be brief."},
                                                              {"role": "user", "content": PROMPTS[1]}],
                                          max_tokens=24, temperature=0)
    answers = {}
    for speculation in ("on", "off"):
        extra = {"speculation": speculation}
        text = client.responses.create(model="", instructions="Be brief.", input=PROMPTS[1], max_output_tokens=24,
                                       temperature=0, extra_body=extra)
        assert text.output_text == chat.choices[0].message.content
        events = list(client.responses.create(model="", instructions="Be brief.", input=PROMPTS[1],
                                              max_output_tokens=24, temperature=0, stream=True, extra_body=extra))
        assert events[-1].response.output_text == text.output_text
        shaped = client.responses.create(model="", input=PROMPTS[2], max_output_tokens=60, temperature=0,
                                         text={"format": {"type": "json_schema", "name": "s", "schema": SETTINGS}},
                                         extra_body=extra)
        jsonschema.validate(json.loads(shaped.output_text), SETTINGS)
        called = client.responses.create(model="", input=PROMPTS[0], max_output_tokens=60, temperature=0,
                                         tools=[{"type": "function", "name": "set_units", "parameters": SETTINGS}],
                                         tool_choice="required", parallel_tool_calls=False, extra_body=extra)
        assert [item.type for item in called.output] == ["function_call"]
        jsonschema.validate(json.loads(called.output[0].arguments), SETTINGS)
        answers[speculation] = (text.output_text, shaped.output_text, called.output[0].arguments)
    assert answers["on"] == answers["off"]


def test_a_predicted_output_is_drafted_from_and_changes_nothing_but_the_rounds(stack) -> None:
    """The answer itself as the prediction: the draft copies it (accepted, in the usage), and the
    answer is the one without a prediction, over HTTP and gRPC."""
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
    messages = [{"role": "user", "content": PROMPTS[0]}]
    plain = client.chat.completions.create(model="", messages=messages, max_tokens=40, temperature=0,
                                           extra_body={"speculation": "on"})
    answer = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    predicted = client.chat.completions.create(model="", messages=messages, max_tokens=40, temperature=0,
                                               prediction={"type": "content", "content": answer},
                                               extra_body={"speculation": "on"})
    assert predicted.choices[0].message.content == answer
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= predicted.usage.completion_tokens // 2, predicted.usage
    assert predicted.usage.speculative_decoding["rounds"] < plain.usage.speculative_decoding["rounds"]
    ids, text, chunks = grpc_generate(stack, messages=[gateway_pb2.ChatMessage(role="user", content=PROMPTS[0])],
                                      max_tokens=40, temperature=0, prediction=answer,
                                      speculation=common_pb2.SPECULATION_MODE_ON)
    assert text == answer and chunks[-1].usage.accepted_prediction_tokens > 0


def test_the_next_turn_prefills_only_what_is_new_and_answers_the_same(stack, reference) -> None:
    """A conversation's second request starts with the first's prompt and answer: the target copies
    their KV cache (usage ``prompt_tokens_details.cached_tokens``) and answers as a whole prefill would."""
    tokenizer, greedy = reference
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    first_prompt = tokenizer(PROMPTS[2] * 3).input_ids
    first = client.completions.create(model=model, prompt=first_prompt, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
    answer = greedy(first_prompt, 16)
    second_prompt = first_prompt + answer + tokenizer(" and then").input_ids[1:]
    second = client.completions.create(model=model, prompt=second_prompt, max_tokens=16, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert first.choices[0].text == tokenizer.decode(answer, skip_special_tokens=True)
    assert second.choices[0].text == tokenizer.decode(greedy(second_prompt, 16), skip_special_tokens=True)
    assert second.usage.prompt_tokens_details.cached_tokens == len(first_prompt) + 16 - 1
    metrics = httpx.get(f"http://127.0.0.1:{stack.target_metrics_port}/metrics").text
    assert metric_value(metrics, "tandem_target_prompt_tokens_total", outcome="hit") >= len(first_prompt) + 15


def test_health_and_reflection_on_all_three(stack) -> None:
    for port, service in ((stack.target_port, "tandem.v1.TargetService"), (stack.draft_port, "tandem.v1.DraftService"),
                          (stack.grpc_port, "tandem.v1.GatewayService")):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            reply = next(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([request]), timeout=5))
            assert service in [s.name for s in reply.list_services_response.service]
    assert httpx.get(f"{stack.base_url}/health", timeout=5).status_code == 200


def test_client_disconnect_frees_sessions_everywhere(stack) -> None:
    body = {"model": "ignored-by-check", "prompt": "def fibonacci(n):", "max_tokens": 400, "temperature": 0,
            "stream": True, "ignore_eos": True}
    body["model"] = httpx.get(f"{stack.base_url}/v1/models").json()["data"][0]["id"]
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{stack.base_url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            seen = 0
            for line in response.iter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen >= 3:
                    break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 20
    while True:
        gateway_active = metric_value(stack.metrics(), "tandem_sessions_active")
        target_active = metric_value(stack.metrics(stack.target_metrics_port), "tandem_sessions_active")
        draft_active = metric_value(stack.metrics(stack.draft_metrics_port), "tandem_sessions_active")
        if gateway_active == target_active == draft_active == 0:
            break
        assert time.monotonic() < deadline, (gateway_active, target_active, draft_active)
        time.sleep(0.2)
    # And the stack keeps serving.
    ids, _, _ = grpc_generate(stack, prompt="hello", max_tokens=4, temperature=0.0)
    assert 1 <= len(ids) <= 4


def test_tokenizer_mismatch_stops_the_stack_with_a_clear_error(tiny_dir, tmp_path) -> None:
    from tiny import make_tiny_model

    other = make_tiny_model(tmp_path / "other-tokenizer", seed=5, tokenizer_vocab_size=280)
    with pytest.raises(RuntimeError) as failure:
        with running_stack(str(tiny_dir), str(other), ready_timeout_s=120):
            pass
    message = str(failure.value)
    assert "tokenizer" in message.lower() and str(other.name) in message and str(tiny_dir.name) in message


def test_a_killed_service_is_restarted_and_the_stack_serves_again(tiny_dir, tiny_draft_dir) -> None:
    """The supervisor restarts a child that dies (here the target, SIGKILLed) instead of stopping
    the stack; once it serves again, requests succeed and it reports the restart."""
    import psutil

    from stack import is_serving

    with running_stack(str(tiny_dir), str(tiny_draft_dir), k=4) as stack:
        def target_child() -> psutil.Process | None:
            children = psutil.Process(stack.process.pid).children()
            return next((p for p in children if p.is_running() and p.cmdline()[3:4] == ["target"]), None)

        first = target_child()
        first.kill()
        first.wait(timeout=30)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            second = target_child()
            if second is not None and second.pid != first.pid and is_serving(f"127.0.0.1:{stack.target_port}", 1.0):
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"the target was not restarted:\n{stack.log()}")
        assert stack.process.poll() is None  # the stack kept running
        ids: list[int] = []
        while not ids and time.monotonic() < deadline:  # until the gateway sees the target again
            try:
                ids, _, _ = grpc_generate(stack, prompt="def fibonacci(n):", max_tokens=8, temperature=0.0,
                                          speculation=common_pb2.SPECULATION_MODE_ON)
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.UNAVAILABLE, error
                time.sleep(0.5)
        assert len(ids) == 8
        assert metric_value(stack.metrics(stack.target_metrics_port), "tandem_process_restarts") == 1
        assert "restarting target (restart 1)" in stack.log()

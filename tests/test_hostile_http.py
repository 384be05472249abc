"""Property-based tests (hypothesis) of the gateway's bodies: any JSON, or none, sent to the OpenAI
routes, and any GatewayService GenerateRequest over gRPC, gets an answer below 500 (a clear 4xx
or a completion), never a server error; a valid request afterwards gets the same tokens as before
the storm. The gateway runs on the scripted fake upstreams (gateway_fakes)."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from gateway_fakes import fake_stack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_hostile_rpc import LoopThread

from tandem.models import load_tokenizer
from tandem.v1 import gateway_pb2, gateway_pb2_grpc

FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
          "seed", "stop", "stream", "stream_options", "speculation", "num_speculative_tokens", "ignore_eos",
          "stream_smoothing", "logit_bias", "presence_penalty", "logprobs", "echo", "suffix", "best_of", "user",
          "response_format", "tools", "tool_choice", "parallel_tool_calls", "prediction", "tokens",
          "add_generation_prompt", "return_token_strs", "input", "instructions", "max_output_tokens", "text",
          "previous_response_id", "store"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=30))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=12)
messages = st.lists(st.fixed_dictionaries({}, optional={"role": st.sampled_from(["user", "system", "assistant", "x", ""]),
                                                        "content": st.one_of(st.text(max_size=40), json_values)}),
                    max_size=3)
bodies = st.one_of(
    json_values,
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6),
    st.fixed_dictionaries({"prompt": st.one_of(st.text(max_size=60), st.lists(st.integers(-5, 70_000), max_size=8))},
                          optional={k: json_values for k in ("max_tokens", "temperature", "stream", "stop", "top_p")}),
    st.fixed_dictionaries({"messages": messages}, optional={k: json_values for k in ("max_tokens", "stream", "n")}),
    # Tool calls: well-formed tools around hostile names, schemas and choices.
    st.fixed_dictionaries(
        {"messages": messages,
         "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
             {"name": st.one_of(st.sampled_from(["f", "get_weather"]), st.text(max_size=8))},
             optional={"parameters": st.one_of(json_values, st.just({"type": "object", "properties": {
                 "a": {"type": "integer"}}}))})}), max_size=3)},
        optional={"tool_choice": st.one_of(json_values, st.sampled_from(["auto", "required", "none"]),
                                           st.just({"type": "function", "function": {"name": "f"}})),
                  "max_tokens": st.integers(1, 8), "stream": st.booleans(), "parallel_tool_calls": json_values}),
    st.fixed_dictionaries({"input": st.one_of(st.text(max_size=20), st.lists(st.fixed_dictionaries(
        {}, optional={"type": st.sampled_from(["message", "function_call", "function_call_output", "x"]),
                      "role": st.sampled_from(["user", "assistant", "tool", ""]), "content": json_values,
                      "call_id": json_values, "name": json_values, "arguments": json_values,
                      "output": json_values}), max_size=3))},
                          optional={"text": json_values, "tools": json_values, "max_output_tokens": json_values,
                                    "stream": st.booleans(), "instructions": json_values}),
    st.fixed_dictionaries({"prompt": st.text(max_size=20)},
                          optional={"logit_bias": st.dictionaries(st.text(max_size=6), json_values, max_size=3),
                                    "prediction": json_values, "max_tokens": st.integers(1, 8)}),
)


@pytest.fixture(scope="module")
def gateway(tiny_dir):
    background = LoopThread()
    context = fake_stack(load_tokenizer(str(tiny_dir)), str(tiny_dir))
    stack = background.run(context.__aenter__())
    yield stack
    background.run(context.__aexit__(None, None, None))
    background.close()


def valid_text(client: httpx.Client) -> str:
    reply = client.post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 8, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def client(gateway):
    with httpx.Client(base_url=gateway.base_url, timeout=60) as http:
        yield http


@pytest.fixture(scope="module")
def baseline(client) -> str:
    return valid_text(client)


@FUZZ
@given(route=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"]),
       body=bodies)
def test_any_json_body_gets_a_clear_answer_below_500(client, baseline, route, body):
    with client.stream("POST", route, json=body) as reply:
        text = reply.read().decode(errors="replace")
    assert reply.status_code < 500, (body, reply.status_code, text)
    if reply.status_code >= 400:
        error = json.loads(text)["error"]
        assert error["message"] and error["type"], text
    assert valid_text(client) == baseline


@FUZZ
@given(raw=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode)),
       content_type=st.sampled_from(["application/json", "text/plain", ""]))
def test_any_bytes_get_a_clear_answer_below_500(client, baseline, raw, content_type):
    reply = client.post("/v1/completions", content=raw, headers={"content-type": content_type} if content_type else {})
    assert reply.status_code < 500, (raw, reply.status_code, reply.text)
    assert valid_text(client) == baseline


sampling_floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
generate_requests = st.builds(
    gateway_pb2.GatewayServiceGenerateRequest,
    model=st.one_of(st.just(""), st.text(max_size=20)),
    prompt=st.text(max_size=40),
    prompt_token_ids=st.lists(st.integers(min_value=-(2**31), max_value=2**31 - 1), max_size=6),
    messages=st.lists(st.builds(gateway_pb2.ChatMessage, role=st.text(max_size=10), content=st.text(max_size=30)),
                      max_size=2),
    max_tokens=st.integers(min_value=-(2**31), max_value=2**31 - 1),
    temperature=sampling_floats, top_p=sampling_floats, top_k=st.integers(min_value=-(2**31), max_value=2**31 - 1),
    seed=st.integers(min_value=0, max_value=2**64 - 1),
    stop=st.lists(st.text(max_size=5), max_size=3),
    speculation=st.integers(min_value=0, max_value=7),
    num_speculative_tokens=st.integers(min_value=-(2**31), max_value=2**31 - 1),
    ignore_eos=st.booleans(),
    stream_smoothing=st.integers(min_value=0, max_value=5),
)


@pytest.fixture(scope="module")
def gateway_stub(gateway):
    with grpc.insecure_channel(gateway.grpc_address) as channel:
        yield gateway_pb2_grpc.GatewayServiceStub(channel)


@FUZZ
@given(request=generate_requests)
def test_any_generate_request_is_served_or_refused_clearly(gateway_stub, client, baseline, request):
    try:
        list(gateway_stub.Generate(request, timeout=60))
    except grpc.RpcError as error:
        assert error.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (request, error.details())
        assert error.details()
    assert valid_text(client) == baseline

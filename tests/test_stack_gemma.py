"""Whole stack on the real built-in default target, gemma-3-270m (loaded offline from its package).

Greedy losslessness is checked token for token: with ``--dtype float32`` against transformers'
own ``generate()``, and with the default (the target computes on the GGUF file's blocks) against
the same server's autoregressive decoding (``speculation: off``), with the ``ngram`` draft, the
``eagle`` head shipped for the target and a model draft, including a prompt longer than Gemma 3's
512-token sliding window; the outside contract checker runs against the default ports, on a
loopback address of their own (127.0.0.2), so that a ``tandem serve`` on the machine does not clash.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from stack import running_stack
from tiny import make_tiny_model

from tandem.models import load_model, resolve
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.slow

CONTRACT = Path(__file__).resolve().parents[2] / "shared" / "contract" / "check_contract.py"
CODE_PROMPT = "def binary_search(items, target):\n    \"\"\"Return the index of target in the sorted list items, or -1.\"\"\"\n"


def long_prompt(tokenizer) -> list[int]:
    """A real text of about 700 tokens: longer than the 512-token sliding window."""
    import inspect
    import json as json_module

    text = inspect.getsource(json_module.JSONEncoder.encode) + inspect.getsource(json_module.JSONEncoder.iterencode)
    ids = tokenizer(text).input_ids
    assert len(ids) > 600, len(ids)
    return ids[:700]


@pytest.fixture(scope="module")
def gemma():
    loaded = load_model("gemma-3-270m", device="cpu", dtype="float32")

    def greedy(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        with torch.no_grad():
            out = loaded.model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
        return out[0, len(prompt_ids):].tolist()

    return loaded.tokenizer, greedy


def generate_ids(address: str, prompt_ids: list[int], max_tokens: int, speculation: int) -> tuple[list[int], object]:
    with grpc.insecure_channel(address) as channel:
        chunks = list(gateway_pb2_grpc.GatewayServiceStub(channel).Generate(
            gateway_pb2.GatewayServiceGenerateRequest(
                prompt_token_ids=prompt_ids, max_tokens=max_tokens, temperature=0.0, speculation=speculation),
            timeout=300))
    return [t for c in chunks for t in c.token_ids], chunks[-1].usage


def test_default_stack_ngram_is_lossless_and_meets_the_contract(gemma) -> None:
    tokenizer, greedy = gemma
    with running_stack("gemma-3-270m", "ngram", k=5, default_ports=True, ready_timeout_s=600,
                       extra_args=("--dtype", "float32")) as stack:
        for prompt_ids, n in ((tokenizer(CODE_PROMPT).input_ids, 32), (long_prompt(tokenizer), 24)):
            expected = greedy(prompt_ids, n)
            for mode in (common_pb2.SPECULATION_MODE_ON, common_pb2.SPECULATION_MODE_OFF):
                ids, usage = generate_ids(stack.grpc_address, prompt_ids, n, mode)
                assert ids == expected, (mode, len(prompt_ids))
            assert usage.speculative_decoding.mode == "autoregressive"
        # The checker lives in shared/, beside the checkout (as in CI and every session).
        assert CONTRACT.exists(), f"contract checker not found at {CONTRACT}"
        result = subprocess.run([sys.executable, str(CONTRACT), "--host", stack.host, "--http", stack.base_url],
                                capture_output=True, text=True, timeout=600, check=False)
        assert result.returncode == 0, result.stdout + result.stderr


def served_greedy(address: str, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The served target's own greedy decoding: the same server with speculation off."""
    ids, usage = generate_ids(address, prompt_ids, max_tokens, common_pb2.SPECULATION_MODE_OFF)
    assert usage.speculative_decoding.mode == "autoregressive"
    return ids


def test_model_draft_with_the_gemma_tokenizer_is_lossless(gemma, tmp_path) -> None:
    tokenizer, _ = gemma
    draft_dir = make_tiny_model(tmp_path / "gemma-draft", seed=3, arch="gemma3", hidden_size=32, num_layers=2,
                                sliding_window=512, tokenizer_from=resolve("gemma-3-270m").hf_dir)
    with running_stack("gemma-3-270m", str(draft_dir), k=3, ready_timeout_s=600) as stack:
        for prompt_ids, n in ((tokenizer(CODE_PROMPT).input_ids, 16), (long_prompt(tokenizer), 12)):
            ids, usage = generate_ids(stack.grpc_address, prompt_ids, n, common_pb2.SPECULATION_MODE_ON)
            assert ids == served_greedy(stack.grpc_address, prompt_ids, n)
            assert usage.speculative_decoding.rounds > 0


@pytest.mark.parametrize(("draft", "proposer"), [("eagle", "eagle"), ("auto", "ngram+eagle")])
def test_shipped_eagle_head_is_lossless(gemma, draft, proposer) -> None:
    """The eagle draft for the default target: it drafts from the target's hidden states, which the
    draft asks for per block (the gateway prefills without them); and the default pair, lookup and
    the head, whose greedy sessions send token trees."""
    tokenizer, _ = gemma
    with running_stack("gemma-3-270m", draft, k=7 if draft == "auto" else 5, ready_timeout_s=600) as stack:
        with grpc.insecure_channel(f"{stack.host}:{stack.draft_port}") as channel:
            info = draft_pb2_grpc.DraftServiceStub(channel).Info(draft_pb2.DraftServiceInfoRequest(), timeout=30)
        assert (info.proposer, info.model_name) == (proposer, "eagle:gemma-3-270m")
        for prompt_ids, n in ((tokenizer(CODE_PROMPT).input_ids, 32), (long_prompt(tokenizer), 16)):
            ids, usage = generate_ids(stack.grpc_address, prompt_ids, n, common_pb2.SPECULATION_MODE_ON)
            assert ids == served_greedy(stack.grpc_address, prompt_ids, n), len(prompt_ids)
            assert usage.speculative_decoding.rounds > 0 and usage.speculative_decoding.draft_tokens > 0
        if draft == "auto":
            assert_structured_output_is_lossless(stack)
            assert_tool_calls_are_lossless(stack)


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130}},
          "required": ["name", "age"], "additionalProperties": False}


def assert_structured_output_is_lossless(stack) -> None:
    """Under a JSON schema, the default pair's drafts (guided by the schema once the draft has
    compiled it) commit what the served target decodes under it: the same valid JSON."""
    messages = [gateway_pb2.ChatMessage(role="user",
                                        content="Extract name and age as JSON: Maria Lopez, 34, lives in Barcelona.")]
    grammar = common_pb2.Grammar(kind=common_pb2.GRAMMAR_KIND_JSON_SCHEMA, spec=json.dumps(PERSON))
    answers = {}
    for attempt in range(2):  # the first meets the draft compiling the schema: it drafts unguided
        for mode in (common_pb2.SPECULATION_MODE_ON, common_pb2.SPECULATION_MODE_OFF):
            with grpc.insecure_channel(stack.grpc_address) as channel:
                chunks = list(gateway_pb2_grpc.GatewayServiceStub(channel).Generate(
                    gateway_pb2.GatewayServiceGenerateRequest(messages=messages, max_tokens=48, temperature=0.0,
                                                              speculation=mode, grammar=grammar), timeout=300))
            answers[attempt, mode] = "".join(c.text for c in chunks)
            assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_STOP
        assert answers[attempt, common_pb2.SPECULATION_MODE_ON] == answers[attempt, common_pb2.SPECULATION_MODE_OFF]
        if attempt == 0:
            time.sleep(3)  # the draft compiles the schema meanwhile
    assert json.loads(answers[1, common_pb2.SPECULATION_MODE_ON]) == {"name": "Maria Lopez", "age": 34}


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIMER_TOOL = {"type": "function", "function": {
    "name": "set_timer", "parameters": {"type": "object", "properties": {"minutes": {"type": "integer", "maximum": 1440}},
                                        "required": ["minutes"], "additionalProperties": False}}}


def assert_tool_calls_are_lossless(stack) -> None:
    """gemma-3-270m, told its tools by the gateway, calls the one the request needs, with the
    arguments it asks for; speculation makes the same call."""
    body = {"messages": [{"role": "user", "content": "What's the weather like in Lisbon right now? Use celsius."}],
            "tools": [WEATHER_TOOL, TIMER_TOOL], "tool_choice": "required", "parallel_tool_calls": False,
            "max_tokens": 64, "temperature": 0}
    calls = {}
    for mode in ("on", "off"):
        answer = httpx.post(f"{stack.base_url}/v1/chat/completions", json={**body, "speculation": mode},
                            timeout=300).json()
        assert answer["choices"][0]["finish_reason"] == "tool_calls", answer
        calls[mode] = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                       for c in answer["choices"][0]["message"]["tool_calls"]]
    assert calls["on"] == calls["off"] == [("get_weather", {"city": "Lisbon", "unit": "celsius"})]

"""Whole stack, real processes on free ports: session fallback and surviving a draft outage.

* A random-weight draft that shares the target's tokenizer accepts almost nothing: sessions fall
  back to the target's Generate, and the output is still the target's greedy output.
* The draft is SIGKILLed while streams are speculating: every stream completes with the target's
  greedy output, new sessions start in fallback; restarted with the same command line, the draft
  is used again by new sessions.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stack import metric_value, running_services
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

PROMPTS = ["def fibonacci(n):", "The quick brown fox", '{"name": "tandem", "items": [']
AUTO = common_pb2.SPECULATION_MODE_AUTO


@pytest.fixture(scope="module")
def greedy(tiny_dir):
    """The target's own greedy continuation (transformers), and its tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()

    def continuation(prompt: str, max_new_tokens: int) -> tuple[list[int], list[int]]:
        prompt_ids = tokenizer(prompt).input_ids
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
        return prompt_ids, out[0, len(prompt_ids):].tolist()

    return continuation


def generate(address: str, prompt_ids: list[int], max_tokens: int, on_first=None):
    """Token ids and usage of one gRPC Generate stream (greedy, speculation auto)."""
    request = gateway_pb2.GatewayServiceGenerateRequest(
        prompt_token_ids=prompt_ids, max_tokens=max_tokens, temperature=0.0, speculation=AUTO
    )
    ids, usage = [], None
    with grpc.insecure_channel(address) as channel:
        for chunk in gateway_pb2_grpc.GatewayServiceStub(channel).Generate(request, timeout=120):
            ids += chunk.token_ids
            if chunk.HasField("usage"):
                usage = chunk.usage.speculative_decoding
            if on_first is not None and len(ids) > 1:
                on_first()
                on_first = None
    return ids, usage


def test_a_draft_that_accepts_nothing_makes_sessions_fall_back_losslessly(tiny_dir, tiny_draft_dir, greedy,
                                                                         tmp_path):
    with running_services(str(tiny_dir), str(tiny_draft_dir), str(tmp_path)) as services:
        for prompt in PROMPTS[:2]:
            prompt_ids, expected = greedy(prompt, 48)
            ids, usage = generate(services.grpc_address, prompt_ids, 48)
            assert ids == expected, prompt
            if len(expected) > 16:  # long enough for the warm-up and a decision
                assert usage.mode == "mixed" and usage.fallbacks >= 1 and usage.rounds >= 4, usage
        metrics = services.metrics()
        switched = sum(metric_value(metrics, "tandem_session_fallbacks_total", reason=reason)
                       for reason in ("low_acceptance", "slower_than_autoregressive"))
        assert switched >= 1
        assert "tandem_sessions_active{mode=" in metrics


def test_killing_and_restarting_the_draft_mid_stream(tiny_dir, greedy, tmp_path):
    # The draft is the target itself (every draft token accepted), and measurement-based
    # switching is off, so streams are speculating when the draft dies. It dies as soon as the
    # first stream has tokens: a tiny model speculates a whole stream in a fraction of a second
    # (faster still with the target batching the streams' passes), so waiting for every stream's
    # first tokens let one finish before the kill now and then.
    env = {"TANDEM_FALLBACK_ADAPTIVE": "false", "TANDEM_DRAFT_BREAKER_COOLDOWN_S": "0.5",
           "TANDEM_FALLBACK_REPROBE_TOKENS": "16"}
    with running_services(str(tiny_dir), str(tiny_dir), str(tmp_path), gateway_env=env) as services:
        cases = [greedy(prompt, 160) for prompt in PROMPTS]
        results: dict[int, tuple] = {}
        started = [threading.Event() for _ in cases]
        kill_once = threading.Lock()
        killed = threading.Event()

        def first_tokens(i: int) -> None:
            with kill_once:
                if not killed.is_set():
                    services.kill("draft")
                    killed.set()
            started[i].set()

        def stream(i: int) -> None:
            results[i] = generate(services.grpc_address, cases[i][0], 160, on_first=lambda: first_tokens(i))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(cases))]
        for thread in threads:
            thread.start()
        for event in started:
            assert event.wait(60)
        assert killed.is_set()
        for thread in threads:
            thread.join(120)
        for i, (_, expected) in enumerate(cases):
            ids, usage = results[i]
            assert ids == expected, PROMPTS[i]  # nothing lost, duplicated or reordered
            assert usage.fallbacks >= 1 and usage.mode in ("mixed", "autoregressive"), usage
        assert metric_value(services.metrics(), "tandem_session_fallbacks_total", reason="draft_unavailable") >= 3

        # While the draft is down, new sessions start in fallback without trying it.
        prompt_ids, expected = greedy(PROMPTS[0], 12)
        ids, usage = generate(services.grpc_address, prompt_ids, 12)
        assert ids == expected and (usage.mode, usage.rounds) == ("autoregressive", 0)

        services.start("draft")  # the same command line, by hand
        services.wait_serving("draft")
        deadline = time.monotonic() + 30
        while True:  # the gateway's health probe half-opens the breaker within a few seconds
            ids, usage = generate(services.grpc_address, prompt_ids, 12)
            assert ids == expected
            if usage.rounds > 0:
                break
            assert time.monotonic() < deadline, "speculation did not resume after the draft came back"
            time.sleep(0.5)
        assert usage.mode in ("speculative", "mixed")

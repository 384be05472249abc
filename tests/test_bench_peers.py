"""tandem bench's URL peers (--peer-url): fake OpenAI-compatible servers on free loopback ports."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from gateway_fakes import fake_stack, tokenizer  # noqa: F401  (fixtures)
from test_bench_gateway import bench_args, prompts_file  # noqa: F401  (fixture)

from tandem.tools import bench
from tandem.tools.bench.client import RequestOptions, RequestResult, run_one
from tandem.tools.bench.peers import UrlPeer, base_url, check_url, peer_modes, resolve_peers, run_peer_one
from tandem.tools.bench.prompts import Prompt
from tandem.tools.bench.report import build_report, format_report
from tandem.tools.bench.stack import free_port

TANDEM_FIELDS = {"speculation", "num_speculative_tokens", "stream_smoothing"}


class FakePeer:
    """An OpenAI-compatible completions server on 127.0.0.1, port chosen by the OS.

    ``answer(prompt)`` gives the text chunks of a completion, streamed one SSE chunk each; with
    ``usage`` a final usage chunk (choices empty) says how many tokens (``tokens_per_chunk`` per
    chunk) and holds ``usage_extra``. ``models`` None answers 404 to GET /v1/models; ``status`` other
    than 200 answers completions with that error. Every completion body is kept in ``bodies``.
    """

    def __init__(self, answer: Callable[[str], list[str]] = lambda prompt: ["Hello", " wor", "ld"], *,
                 usage: bool = True, models: list[str] | None = ("peer-model",), status: int = 200,
                 tokens_per_chunk: int = 2, usage_extra: Callable[[dict], dict] | None = None) -> None:
        self.answer, self.usage, self.models, self.status = answer, usage, models, status
        self.tokens_per_chunk, self.usage_extra = tokens_per_chunk, usage_extra
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakePeer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _send(self, status: int, payload: bytes, content_type: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self) -> None:
                if self.path == "/v1/models" and fake.models is not None:
                    data = {"object": "list", "data": [{"id": m, "object": "model"} for m in fake.models]}
                    self._send(200, json.dumps(data).encode())
                else:
                    self._send(404, b'{"error": {"message": "not found"}}')

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.bodies.append(body)
                if self.path != "/v1/completions" or fake.status != 200:
                    self._send(fake.status if fake.status != 200 else 404, b'{"error": {"message": "peer broke"}}')
                    return
                pieces = fake.answer(body["prompt"])[: body["max_tokens"]]
                events = [{"choices": [{"index": 0, "text": p, "finish_reason": None}]} for p in pieces]
                if fake.usage:
                    usage = {"prompt_tokens": 3, "completion_tokens": fake.tokens_per_chunk * len(pieces)}
                    usage.update(fake.usage_extra(body) if fake.usage_extra else {})
                    events.append({"choices": [], "usage": usage})
                stream = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
                self._send(200, stream.encode(), "text/event-stream")

        return Handler


PROMPT = Prompt("code", "def f():")
OPTIONS = RequestOptions("tandem-model", 16, num_speculative_tokens=4, stream_smoothing="off")


def test_mode_names_are_host_port_and_distinct() -> None:
    assert peer_modes(["http://127.0.0.1:8080", "http://localhost:11434/v1/", "http://127.0.0.1:8080/",
                       "https://api.example.com", "http://[::1]:9"]) == [
        "peer:127.0.0.1:8080", "peer:localhost:11434", "peer:127.0.0.1:8080#2", "peer:api.example.com:443",
        "peer:[::1]:9"]
    assert base_url("http://h:1/v1/") == "http://h:1" and base_url("http://h:1/") == "http://h:1"
    assert check_url("http://127.0.0.1:8080") is None
    assert "http(s) URL" in check_url("127.0.0.1:8080") and "bad port" in check_url("http://h:99999")


@pytest.mark.parametrize("usage", [True, False])
def test_a_peer_request_has_no_tandem_fields_and_counts_tokens(usage: bool) -> None:
    with FakePeer(usage=usage) as fake, httpx.Client(timeout=10) as client:
        (peer,) = resolve_peers(client, [fake.url + "/v1"], "tandem-model")
        assert (peer.url, peer.model, peer.model_from) == (fake.url, "peer-model", "GET /v1/models")
        result = run_peer_one(client, peer, PROMPT, OPTIONS, prompt_index=3)
    (body,) = fake.bodies
    assert not TANDEM_FIELDS & body.keys()
    assert body == {"model": "peer-model", "prompt": "def f():", "max_tokens": 16, "temperature": 0.0,
                    "stream": True, "stream_options": {"include_usage": True}}
    assert result.mode == peer.mode and result.prompt_index == 3 and result.text == "Hello world"
    assert (result.completion_tokens, result.extra["tokens_from"]) == ((6, "usage") if usage else (3, "chunks"))
    assert len(result.chunk_gaps_s) == 2 and result.rounds == result.draft_tokens == 0


def test_a_peer_gets_the_truncation_asked_for() -> None:
    """--top-p, --top-k and --min-p go to peers too: llama.cpp and vLLM read the same fields."""
    with FakePeer() as fake, httpx.Client(timeout=10) as client:
        (peer,) = resolve_peers(client, [fake.url], "tandem-model")
        run_peer_one(client, peer, PROMPT, RequestOptions("tandem-model", 4, 0.8, sampling=(("top_k", 40),
                                                                                              ("min_p", 0.05))))
    assert (fake.bodies[0]["top_k"], fake.bodies[0]["min_p"], fake.bodies[0]["temperature"]) == (40, 0.05, 0.8)
    assert not TANDEM_FIELDS & fake.bodies[0].keys()


def test_a_peer_without_a_models_list_gets_the_tandem_model_id() -> None:
    with FakePeer(models=None) as fake, httpx.Client(timeout=10) as client:
        (peer,) = resolve_peers(client, [fake.url], "tandem-model")
        run_peer_one(client, peer, PROMPT, RequestOptions("tandem-model", 4, temperature=None))
    assert peer.model == "tandem-model" and peer.model_from.startswith("the tandem model id")
    assert fake.bodies[0]["model"] == "tandem-model" and "temperature" not in fake.bodies[0]


def result(mode: str, index: int, e2e: float, text: str = "x", domain: str = "code", error: str | None = None,
           source: str | None = None) -> RequestResult:
    extra = {"tokens_from": source} if source else {}
    return RequestResult(domain, mode, 10, 0.1, e2e, [0.1] * 9, text=text, prompt_index=index, error=error,
                         extra=extra)


PEER_A = UrlPeer("http://127.0.0.1:1", "peer:127.0.0.1:1", "m", "GET /v1/models")
PEER_B = UrlPeer("http://127.0.0.1:2", "peer:127.0.0.1:2", "m", "the tandem model id (no list)")


def synthetic_run() -> list[RequestResult]:
    """Prompt 0 (code), 1 (prose). Speculative 2x, peer A 0.5x, peer B 1x of autoregressive."""
    rows = []
    for index, domain in enumerate(("code", "prose")):
        rows += [result("speculative", index, 1.0, f"t{index}", domain),
                 result("autoregressive", index, 2.0, f"t{index}", domain),
                 result(PEER_A.mode, index, 4.0, f"t{index}" if index == 0 else "other", domain, source="usage"),
                 result(PEER_B.mode, index, 2.0, "b", domain, source="chunks" if index else "usage")]
    return rows


def test_report_rows_speedups_and_identical_counts() -> None:
    report = build_report("http://x", "m", 10, synthetic_run(), url_peers=[PEER_A, PEER_B])
    assert list(report.overall) == ["speculative", "autoregressive", PEER_A.mode, PEER_B.mode]
    assert set(report.by_domain["prose"]) == set(report.overall)
    assert report.overall[PEER_A.mode].acceptance_rate is None
    a, b = report.peers
    assert a.speedup == {"speculative": pytest.approx(4.0), "autoregressive": pytest.approx(2.0)}
    assert a.speedup_by_domain["prose"] == {"speculative": pytest.approx(4.0), "autoregressive": pytest.approx(2.0)}
    assert (a.outputs_identical, a.outputs_compared, a.completion_tokens_from) == (1, 2, "usage")
    assert (b.outputs_identical, b.outputs_compared, b.completion_tokens_from) == (0, 2, "mixed")
    assert b.speedup["autoregressive"] == pytest.approx(1.0)
    text = format_report(report)
    rows = [line.split() for line in text.splitlines() if PEER_A.mode in line.split()[1:2]]
    assert [r[0] for r in rows] == ["all", "code", "prose"] and rows[0][-2:] == ["-", "-"]
    assert "speedup (speculative / peer tokens/s): 4.00x; code 4.00x, prose 4.00x" in text
    assert "outputs identical to autoregressive: 1 of 2 prompts" in text
    assert "tokens counted from streamed text chunks" in text and "the tandem model id (no list)" in text


def test_each_mode_is_compared_with_the_fastest_peer_of_each_domain() -> None:
    """Peer B is the faster overall and on code, peer A on prose (where it takes 1 s, not 4)."""
    run = [result(r.mode, r.prompt_index, 1.0 if (r.mode, r.domain) == (PEER_A.mode, "prose") else r.e2e_s,
                  r.text, r.domain) for r in synthetic_run()]
    report = build_report("http://x", "m", 10, run, url_peers=[PEER_A, PEER_B])
    fastest = report.fastest_peer
    assert fastest.overall_peer == PEER_B.mode and fastest.peer_by_domain == {"code": PEER_B.mode, "prose": PEER_A.mode}
    assert fastest.speedup["speculative"] == pytest.approx(2.0)
    assert fastest.speedup_by_domain["code"]["speculative"] == pytest.approx(2.0)
    assert fastest.speedup_by_domain["prose"] == {"speculative": pytest.approx(1.0), "autoregressive": pytest.approx(0.5)}
    text = format_report(report)
    assert f"against the fastest peer (overall {PEER_B.mode}; per domain its own fastest):" in text
    assert f"  speculative: 2.00x; code 2.00x ({PEER_B.mode}), prose 1.00x ({PEER_A.mode})" in text
    assert build_report("http://x", "m", 10, run, url_peers=[PEER_A]).fastest_peer is None


def test_outputs_are_not_compared_unless_greedy_with_mode_off() -> None:
    run = synthetic_run()
    hot = build_report("http://x", "m", 10, run, url_peers=[PEER_A], greedy=False).peers[0]
    assert (hot.outputs_identical, hot.outputs_compared) == (None, 0)
    on_only = [r for r in run if r.mode != "autoregressive"]
    report = build_report("http://x", "m", 10, on_only, modes=["speculative"], url_peers=[PEER_A])
    assert report.peers[0].outputs_identical is None and report.speedup is None
    assert report.peers[0].speedup == {"speculative": pytest.approx(4.0)}
    assert "not compared" in format_report(report)


def test_plot_with_peers(tmp_path) -> None:
    from tandem.tools.bench.plot import mode_colours, write_plot

    run = synthetic_run()
    report = build_report("http://x", "m", 10, run, url_peers=[PEER_A, PEER_B])
    path = tmp_path / "peers.png"
    write_plot(report, run, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    many = ["speculative", "autoregressive", "auto", "peer", *(f"peer:h:{i}" for i in range(12))]
    assert len(set(mode_colours(many).values())) == len(many)


def gateway_text(url: str, model: str, prompts: list[Prompt], max_tokens: int) -> dict[str, str]:
    """What the gateway answers each prompt autoregressively (the scripted doubles are deterministic)."""
    with httpx.Client(timeout=30) as client:
        return {p.prompt: run_one(client, url, p, "autoregressive", RequestOptions(model, max_tokens)).text
                for p in prompts}


def split3(text: str) -> list[str]:
    third = max(1, len(text) // 3)
    return [text[:third], text[third:2 * third], text[2 * third:]]


async def test_bench_with_peers_end_to_end(tokenizer, tiny_dir, prompts_file, tmp_path, capsys) -> None:  # noqa: F811
    from tandem.tools.bench.prompts import load_prompts

    json_path, png_path = tmp_path / "bench.json", tmp_path / "bench.png"
    prompts = load_prompts(str(prompts_file))
    async with fake_stack(tokenizer, str(tiny_dir)) as stack:
        texts = await asyncio.to_thread(gateway_text, stack.base_url, tiny_dir.name, prompts, 12)
        with FakePeer(lambda prompt: split3(texts[prompt])) as same, FakePeer(usage=False, models=None) as other:
            args = bench_args("--url", stack.base_url, "--prompts", str(prompts_file), "--max-tokens", "12",
                              "--modes", "on,off,auto", "--peer-url", same.url, "--peer-url", other.url + "/",
                              "--peer", "none", "--concurrency", "2", "--stream-smoothing", "off",
                              "--json", str(json_path), "--plot", str(png_path), "--no-progress")
            assert await asyncio.to_thread(bench.main, args) == 0
        await stack.wait_until_idle()
    data = json.loads(json_path.read_text())
    same_mode, other_mode = (f"peer:127.0.0.1:{fake.server.server_address[1]}" for fake in (same, other))
    assert list(data["overall"]) == ["speculative", "autoregressive", "auto", same_mode, other_mode]
    assert all(s["requests"] == 4 and s["failed"] == 0 for s in data["overall"].values())
    assert set(data["by_domain"]["prose"]) == set(data["overall"])
    assert data["overall"][same_mode]["completion_tokens"] == 4 * 6  # from usage: 3 chunks of 2 tokens
    assert data["overall"][other_mode]["completion_tokens"] == 4 * 3  # counted from its 3 chunks
    assert data["overall"][other_mode]["acceptance_rate"] is None
    by_mode = {p["mode"]: p for p in data["peers"]}
    assert by_mode[same_mode]["completion_tokens_from"] == "usage"
    assert by_mode[other_mode]["completion_tokens_from"] == "chunks"
    assert (by_mode[same_mode]["outputs_identical"], by_mode[same_mode]["outputs_compared"]) == (4, 4)
    assert (by_mode[other_mode]["outputs_identical"], by_mode[other_mode]["outputs_compared"]) == (0, 4)
    assert set(by_mode[same_mode]["speedup"]) == {"speculative", "autoregressive", "auto"}
    assert by_mode[same_mode]["speedup"]["speculative"] > 0
    assert set(by_mode[same_mode]["speedup_by_domain"]) == {"code", "prose"}
    assert by_mode[other_mode]["model"] == tiny_dir.name and "tandem model id" in by_mode[other_mode]["model_from"]
    assert data["config"]["modes"] == ["speculative", "autoregressive", "auto"]
    assert [p["mode"] for p in data["config"]["peers"]] == [same_mode, other_mode]
    assert data["speedup"] > 0 and data["speedup_auto"] > 0 and sum(data["auto_served_modes"].values()) == 4
    for fake in (same, other):  # one warm-up request (8 tokens at most), then the four prompts
        assert len(fake.bodies) == 5 and fake.bodies[0]["max_tokens"] == 8
        assert all(not TANDEM_FIELDS & body.keys() and body["temperature"] == 0.0 for body in fake.bodies)
    assert {b["model"] for b in same.bodies} == {"peer-model"}
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert f"{same_mode}: {same.url}" in out and "outputs identical to autoregressive: 4 of 4" in out


@pytest.mark.parametrize("broken", ["status", "nothing listening"])
async def test_a_peer_that_fails_every_request_does_not_end_the_run(
    tokenizer, tiny_dir, prompts_file, tmp_path, capsys, broken  # noqa: F811
) -> None:
    json_path = tmp_path / "bench.json"
    with FakePeer(status=500) as fake:
        url = fake.url if broken == "status" else f"http://127.0.0.1:{free_port()}"
        async with fake_stack(tokenizer, str(tiny_dir)) as stack:
            args = bench_args("--url", stack.base_url, "--prompts", str(prompts_file), "--max-tokens", "6",
                              "--peer-url", url, "--peer", "none", "--json", str(json_path), "--no-progress")
            assert await asyncio.to_thread(bench.main, args) == 0
    data = json.loads(json_path.read_text())
    (peer,) = data["peers"]
    assert peer["failed"] == 4 and data["overall"][peer["mode"]]["requests"] == 0
    assert data["overall"]["speculative"]["requests"] == 4 and data["overall"]["speculative"]["failed"] == 0
    assert peer["outputs_compared"] == 0 and peer["completion_tokens_from"] is None
    assert any(e.startswith(peer["mode"]) for e in data["errors"])
    captured = capsys.readouterr()
    assert "warm-up of peer:" in captured.err and "every request to peer:" in captured.err
    assert f"4 request(s) failed ({peer['mode']} 4)" in captured.out


def test_bad_peer_urls_are_refused() -> None:
    with pytest.raises(SystemExit, match="tandem bench: --peer-url takes an http"):
        bench.main(bench_args("--url", "http://127.0.0.1:9", "--peer-url", "localhost:8080"))


def _sse(*texts: str) -> bytes:
    chunks = [f'data: {json.dumps({"choices": [{"text": t}]})}\n\n' for t in texts]
    return ("".join(chunks) + "data: [DONE]\n\n").encode()


def test_a_request_the_server_dropped_unanswered_is_sent_once_more() -> None:
    """llama-server closes idle kept-alive connections; a request that meets one gets no answer at
    all and goes again on a fresh connection. Twice unanswered, or a failure after the answer began,
    is the request's error."""
    from tandem.tools.bench.client import stream_completion

    calls: list[int] = []

    def transport(drops: int, body: bytes = _sse("Hel", "lo")) -> httpx.MockTransport:
        def handle(request: httpx.Request) -> httpx.Response:
            calls.append(1)
            if len(calls) <= drops:
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
            return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})
        return httpx.MockTransport(handle)

    with httpx.Client(transport=transport(drops=1)) as client:
        assert stream_completion(client, "http://peer", {"prompt": "x"}).texts == ["Hel", "lo"]
    assert len(calls) == 2
    calls.clear()
    with httpx.Client(transport=transport(drops=2)) as client, pytest.raises(httpx.RemoteProtocolError):
        stream_completion(client, "http://peer", {"prompt": "x"})
    assert len(calls) == 2
    calls.clear()
    with httpx.Client(transport=transport(drops=0, body=b'data: {"error": "boom"}\n\n')) as client, \
            pytest.raises(RuntimeError, match="boom"):
        stream_completion(client, "http://peer", {"prompt": "x"})
    assert len(calls) == 1

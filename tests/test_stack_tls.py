"""The whole stack secured as an operator would run it: ``tandem serve`` with mutual TLS on every
gRPC hop, HTTPS, an API key and the internal token. The OpenAI SDK with the key is served (stream
and not); without it 401; gRPC callers without our client certificate, or with one but without
the token, are refused by draft and target; plaintext to the TLS ports fails; the health probe and
``tandem bench`` work with TLS on."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
from types import SimpleNamespace

import grpc
import httpx
import openai
import pytest
from certs import CA
from stack import serving

from tandem.fleet import read_ready_block
from tandem.rpc.security import HopSecurity
from tandem.tools.bench.stack import free_ports
from tandem.v1 import draft_pb2, draft_pb2_grpc, gateway_pb2, gateway_pb2_grpc, target_pb2, target_pb2_grpc

pytestmark = pytest.mark.slow

KEY = "sk-tls-test-0123456789"
TOKEN = "internal-0123456789"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    ca = CA(folder)
    return SimpleNamespace(ca=ca.pem, server=ca.issue("server"), client=ca.issue("client"))


@pytest.fixture(scope="module")
def secure_stack(tiny_dir, pki):
    names = ("http-port", "grpc-port", "draft-port", "target-port", "draft-metrics-port", "target-metrics-port")
    ports = dict(zip(names, free_ports(len(names))))
    argv = [sys.executable, "-m", "tandem.cli", "serve", "--target-model", str(tiny_dir), "--draft-model", "ngram",
            "--num-speculative-tokens", "4", "--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key),
            "--tls-ca", str(pki.ca), "--http-tls-cert", str(pki.server.cert), "--http-tls-key", str(pki.server.key)]
    for flag, port in ports.items():
        argv += [f"--{flag}", str(port)]
    output: list[str] = []
    env = {"TANDEM_API_KEYS": KEY, "TANDEM_INTERNAL_TOKEN": TOKEN}
    with serving(argv, env, output, ready_timeout_s=300) as process:
        ready = read_ready_block("".join(output))
        yield SimpleNamespace(process=process, output=output, ports=ports, ready=ready,
                              url=f"https://{ready['http']}", gateway=ready["gateway"], draft=ready["draft"],
                              target=ready["target"])


def trusting(pki) -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.load_verify_locations(str(pki.ca))
    return context


def client_security(pki, token: str = TOKEN, cert: bool = True) -> HopSecurity:
    pair = pki.client if cert else None
    return HopSecurity(cert=pair.cert.read_bytes() if pair else None, key=pair.key.read_bytes() if pair else None,
                       ca=pki.ca.read_bytes(), token=token)


def test_the_openai_sdk_with_the_key_is_served_over_https_and_without_it_refused(secure_stack, pki):
    text = "".join(secure_stack.output)
    assert f"OpenAI API    {secure_stack.url}/v1" in text or f"{secure_stack.url}/v1" in text
    assert "mutual (client certificates signed by --tls-ca)" in text
    assert KEY not in text and TOKEN not in text  # secrets stay out of the logs
    with httpx.Client(verify=trusting(pki)) as http:
        sdk = openai.OpenAI(base_url=f"{secure_stack.url}/v1", api_key=KEY, http_client=http)
        model = sdk.models.list().data[0].id
        whole = sdk.completions.create(model=model, prompt="Once upon", max_tokens=12, temperature=0)
        streamed = sdk.completions.create(model=model, prompt="Once upon", max_tokens=12, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == whole.choices[0].text
        assert whole.usage.completion_tokens == 12
        chat = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        # The SDK's default temperature samples, so an end-of-turn token may come first.
        done = chat.choices[0].finish_reason
        assert (done, chat.usage.completion_tokens) == ("length", 4) or (done == "stop" and 1 <= chat.usage.completion_tokens <= 4)
        keyless = openai.OpenAI(base_url=f"{secure_stack.url}/v1", api_key="sk-wrong", http_client=http)
        with pytest.raises(openai.AuthenticationError) as refused:
            keyless.completions.create(model=model, prompt="Once", max_tokens=2)
        assert refused.value.status_code == 401
    # Plaintext HTTP to the HTTPS port gets no answer it could mistake for one.
    with pytest.raises(httpx.HTTPError):
        httpx.get(secure_stack.url.replace("https://", "http://") + "/health", timeout=5)


def info_code(address: str, security: HopSecurity, stub, request) -> grpc.StatusCode | None:
    with security.sync_channel(address) as channel:
        try:
            stub(channel).Info(request, metadata=security.call_metadata, timeout=10)
        except grpc.RpcError as error:
            return error.code()
    return None


@pytest.mark.parametrize("service", ["draft", "target"])
def test_grpc_callers_need_our_certificate_and_the_token(secure_stack, pki, service):
    address = getattr(secure_stack, service)
    stub, request = {"draft": (draft_pb2_grpc.DraftServiceStub, draft_pb2.DraftServiceInfoRequest()),
                     "target": (target_pb2_grpc.TargetServiceStub, target_pb2.TargetServiceInfoRequest())}[service]
    assert info_code(address, client_security(pki), stub, request) is None  # certificate and token: served
    assert info_code(address, client_security(pki, cert=False), stub, request) == grpc.StatusCode.UNAVAILABLE
    assert info_code(address, client_security(pki, token=""), stub, request) == grpc.StatusCode.UNAUTHENTICATED
    assert info_code(address, HopSecurity(token=TOKEN), stub, request) == grpc.StatusCode.UNAVAILABLE  # plaintext
    # Another CA's certificate.
    other = CA(pki.ca.parent / f"other-{service}", "another CA").issue("intruder")
    intruder = HopSecurity(cert=other.cert.read_bytes(), key=other.key.read_bytes(), ca=pki.ca.read_bytes(),
                           token=TOKEN)
    assert info_code(address, intruder, stub, request) == grpc.StatusCode.UNAVAILABLE


def test_the_gateways_grpc_takes_our_certificate_and_the_api_key(secure_stack, pki):
    security = client_security(pki, token="")
    request = gateway_pb2.GatewayServiceGenerateRequest(prompt="Once upon", max_tokens=6, ignore_eos=True)
    with security.sync_channel(secure_stack.gateway) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        replies = list(stub.Generate(request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=60))
        assert sum(len(r.token_ids) for r in replies) == 6
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(request, timeout=60))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with HopSecurity(ca=pki.ca.read_bytes()).sync_channel(secure_stack.gateway) as channel:  # no certificate
        with pytest.raises(grpc.RpcError) as refused:
            gateway_pb2_grpc.GatewayServiceStub(channel).Info(gateway_pb2.GatewayServiceInfoRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_health_probe_and_the_bench_work_with_tls_on(secure_stack, pki):
    env = {**os.environ, "TANDEM_TLS_CA": str(pki.ca), "TANDEM_TLS_CERT": str(pki.client.cert),
           "TANDEM_TLS_KEY": str(pki.client.key)}
    probe = subprocess.run([sys.executable, "-m", "tandem.rpc.healthcheck", secure_stack.target], env=env,
                           capture_output=True, text=True, timeout=60, check=False)
    assert probe.returncode == 0, probe.stdout + probe.stderr
    bench = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "bench", "--url", secure_stack.url, "--api-key", KEY, "--tls-ca",
         str(pki.ca), "--limit", "2", "--max-tokens", "6", "--warmup", "0", "--peer", "none", "--no-progress"],
        capture_output=True, text=True, timeout=300, check=False)
    assert bench.returncode == 0, bench.stdout + bench.stderr
    assert "speculative" in bench.stdout


def test_serve_refuses_plaintext_beyond_loopback_without_insecure(tiny_dir):
    refused = subprocess.run([sys.executable, "-m", "tandem.cli", "serve", "--target-model", str(tiny_dir),
                              "--host", "0.0.0.0", "--http-port", "0"], capture_output=True, text=True, timeout=120,
                             check=False)
    assert refused.returncode != 0
    assert "serve plaintext on 0.0.0.0" in refused.stderr and "--insecure" in refused.stderr
    assert "Traceback" not in refused.stderr

"""Securing the gRPC hops (tandem.rpc.security): settings, the refusal to serve plaintext beyond
loopback, and draft and target over real gRPC with mutual TLS and the internal token: the right
callers get the reference tokens, the wrong ones are refused and the services keep serving."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import grpc
import pytest
from certs import CA
from draft_fakes import generate_greedy, load_tiny
from grpc_health.v1 import health_pb2, health_pb2_grpc

from draft_service.main import start_draft
from draft_service.proposers.ngram import NgramProposer
from tandem.models import tokenizer_fingerprint
from tandem.rpc import healthcheck
from tandem.rpc.endpoints import CHANNEL_OPTIONS
from tandem.rpc.security import TOKEN_KEY, HopSecurity, SecurityError, check_exposure, for_service, is_loopback
from tandem.telemetry.metrics import make_metrics
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from target_service.engine import TargetEngine
from target_service.main import start_target

PROMPT = (2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52)
TOKEN = "s3cret-internal-token"


def settings(**given) -> SimpleNamespace:
    fields = {"tls_cert": None, "tls_key": None, "tls_ca": None, "tls_server_name": None, "internal_token": "",
              "insecure": False, "host": "127.0.0.1"}
    return SimpleNamespace(**{**fields, **given})


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Our CA with one pair per service, and a stranger CA with a pair of its own."""
    folder = tmp_path_factory.mktemp("pki")
    ours = CA(folder / "ours")
    stranger = CA(folder / "stranger", "someone else's CA")
    return SimpleNamespace(ca=ours.pem, target=ours.issue("target"), draft=ours.issue("draft"),
                           client=ours.issue("client"), stranger_ca=stranger.pem, stranger=stranger.issue("stranger"))


def mutual(pki, pair, token: str = TOKEN) -> HopSecurity:
    return HopSecurity.from_settings(settings(tls_cert=str(pair.cert), tls_key=str(pair.key), tls_ca=str(pki.ca),
                                              internal_token=token))


# ------------------------------------------------------------------------------------------ units


def test_settings_name_the_flag_of_a_file_that_cannot_be_read_or_half_a_pair(pki, tmp_path):
    with pytest.raises(SecurityError, match="--tls-ca: cannot read .*missing.pem"):
        HopSecurity.from_settings(settings(tls_ca=str(tmp_path / "missing.pem")))
    with pytest.raises(SecurityError, match="--tls-cert and --tls-key go together"):
        HopSecurity.from_settings(settings(tls_cert=str(pki.target.cert)))
    security = mutual(pki, pki.target)
    assert security.serves_tls and security.mutual and security.dials_tls
    assert security.describe() == "mutual TLS + internal token"
    assert TOKEN not in repr(security)
    assert security.call_metadata == ((TOKEN_KEY, TOKEN),)
    client_only = HopSecurity.from_settings(settings(tls_ca=str(pki.ca)))
    assert client_only.dials_tls and not client_only.serves_tls and client_only.server_credentials() is None
    plain = HopSecurity()
    assert plain.describe() == "plaintext" and plain.call_metadata == () and plain.channel_credentials() is None


def test_a_pool_member_dialled_by_ip_is_checked_against_its_entrys_name_or_the_override(pki):
    security = HopSecurity.from_settings(settings(tls_ca=str(pki.ca)))
    assert ("grpc.ssl_target_name_override", "target") in security.name_options("target")
    forced = HopSecurity.from_settings(settings(tls_ca=str(pki.ca), tls_server_name="tandem.internal"))
    assert ("grpc.ssl_target_name_override", "tandem.internal") in forced.name_options("target")
    assert HopSecurity().name_options("target") == []  # plaintext: nothing to check


@pytest.mark.parametrize("host,loopback", [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True),
                                           ("[::1]", True), ("localhost", True), ("0.0.0.0", False), ("::", False),
                                           ("", False), ("10.1.2.3", False), ("target.example", False)])
def test_loopback_is_what_no_other_machine_can_reach(host, loopback):
    assert is_loopback(host) is loopback


def test_plaintext_beyond_loopback_is_refused_unless_insecure_which_warns(caplog):
    check_exposure("the target", "127.0.0.1", protected=False, insecure=False)  # loopback: fine
    check_exposure("the target", "0.0.0.0", protected=True, insecure=False)  # TLS: fine
    with pytest.raises(SecurityError, match=r"the target would serve plaintext on 0\.0\.0\.0.*--insecure"):
        check_exposure("the target", "0.0.0.0", protected=False, insecure=False)
    caplog.set_level(logging.WARNING)
    check_exposure("the target", "0.0.0.0", protected=False, insecure=True)
    assert "serves plaintext on 0.0.0.0 (--insecure)" in caplog.text
    with pytest.raises(SystemExit, match="tandem draft: error: the draft would serve plaintext on 10.0.0.7"):
        for_service(settings(host="10.0.0.7"), "draft")


# ----------------------------------------------------------------------------- over real gRPC


@pytest.fixture(scope="module")
def llama(tiny_dir):
    return load_tiny(tiny_dir)


@pytest.fixture
async def secured(llama, pki):
    """A target and a draft, both with mutual TLS and the internal token; the draft dials the
    target as 'localhost' (the name in the target's certificate)."""
    target = await start_target(TargetEngine(llama, metrics=make_metrics("target")), security=mutual(pki, pki.target))
    address = f"localhost:{target.port}"
    draft = await start_draft(lambda info: NgramProposer(), address, num_speculative_tokens=4, target_wait_s=10,
                              security=mutual(pki, pki.draft))
    yield SimpleNamespace(target=target, draft=draft, target_address=address,
                          draft_address=f"localhost:{draft.port}")
    await draft.stop(0)
    await target.stop(0)


def params(max_new_tokens: int) -> common_pb2.SessionParams:
    return common_pb2.SessionParams(sampling=common_pb2.SamplingParams(), max_new_tokens=max_new_tokens)


async def generate_through(secured, llama, security: HopSecurity, session_id: str, n: int = 16) -> list[int]:
    """The gateway's part over ``security``: Prefill in the target, Speculate in the draft."""
    fingerprint = tokenizer_fingerprint(llama.tokenizer)
    auth = security.call_metadata
    async with security.aio_channel(secured.target_address, CHANNEL_OPTIONS) as channel:
        first = await target_pb2_grpc.TargetServiceStub(channel).Prefill(
            target_pb2.PrefillRequest(session_id=session_id, prompt_token_ids=PROMPT, params=params(n),
                                      tokenizer_fingerprint=fingerprint), metadata=auth, timeout=30)
    request = draft_pb2.SpeculateRequest(session_id=session_id, token_ids=[*PROMPT, first.token_id],
                                         prompt_len=len(PROMPT), params=params(n), tokenizer_fingerprint=fingerprint)
    async with security.aio_channel(secured.draft_address, CHANNEL_OPTIONS) as channel:
        replies = [r async for r in draft_pb2_grpc.DraftServiceStub(channel).Speculate(request, metadata=auth,
                                                                                       timeout=60)]
    return [first.token_id, *(t for r in replies for t in r.token_ids)]


async def test_mutual_tls_with_the_token_serves_the_reference_tokens(secured, llama, pki):
    tokens = await generate_through(secured, llama, mutual(pki, pki.client), "mtls")
    assert tokens == generate_greedy(llama.model, PROMPT, 16, llama.tokenizer.eos_token_id)


async def refused_code(secured, security: HopSecurity, address: str) -> grpc.StatusCode:
    async with security.aio_channel(address, CHANNEL_OPTIONS) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await target_pb2_grpc.TargetServiceStub(channel).Info(target_pb2.TargetServiceInfoRequest(),
                                                                   metadata=security.call_metadata, timeout=10)
    return refused.value.code()


async def test_callers_without_our_certificate_or_the_token_are_refused_and_others_still_served(
        secured, llama, pki):
    target = secured.target_address
    # No client certificate (server TLS checked against our CA): the handshake fails.
    anonymous = HopSecurity.from_settings(settings(tls_ca=str(pki.ca), internal_token=TOKEN))
    assert await refused_code(secured, anonymous, target) == grpc.StatusCode.UNAVAILABLE
    # A certificate another CA signed.
    stranger = HopSecurity.from_settings(settings(tls_cert=str(pki.stranger.cert), tls_key=str(pki.stranger.key),
                                                  tls_ca=str(pki.ca), internal_token=TOKEN))
    assert await refused_code(secured, stranger, target) == grpc.StatusCode.UNAVAILABLE
    # Plaintext to a TLS port.
    assert await refused_code(secured, HopSecurity(token=TOKEN), target) == grpc.StatusCode.UNAVAILABLE
    # Our certificate without the token, or with another: UNAUTHENTICATED naming the token.
    for token in ("", "guess"):
        security = mutual(pki, pki.client, token=token)
        async with security.aio_channel(target, CHANNEL_OPTIONS) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await target_pb2_grpc.TargetServiceStub(channel).Info(target_pb2.TargetServiceInfoRequest(),
                                                                       metadata=security.call_metadata, timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "internal token" in refused.value.details()
        # The draft's Speculate (a server stream) is refused the same way.
        async with security.aio_channel(secured.draft_address, CHANNEL_OPTIONS) as channel:
            call = draft_pb2_grpc.DraftServiceStub(channel).Speculate(draft_pb2.SpeculateRequest(session_id="x"),
                                                                      metadata=security.call_metadata)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call.read()
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Health stays open to a certified caller without the token (probes need no secret).
        async with security.aio_channel(target, CHANNEL_OPTIONS) as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    # Whoever was refused, the right caller is served.
    tokens = await generate_through(secured, llama, mutual(pki, pki.client), "after-refusals")
    assert tokens == generate_greedy(llama.model, PROMPT, 16, llama.tokenizer.eos_token_id)


async def test_the_health_probe_speaks_tls_and_says_what_plaintext_met(secured, pki):
    """``python -m tandem.rpc.healthcheck`` (blocking: run beside the servers' event loop)."""
    address = secured.target_address
    serving, seen = await asyncio.to_thread(healthcheck.check, address, "", 5, mutual(pki, pki.client, token=""))
    assert serving and seen == "SERVING"
    serving, seen = await asyncio.to_thread(healthcheck.check, address, "", 5, HopSecurity())
    assert not serving and seen.startswith("UNAVAILABLE") and "pass --tls-ca" in seen
    code = await asyncio.to_thread(healthcheck.main, [address, "--tls-ca", str(pki.ca), "--tls-cert",
                                                      str(pki.client.cert), "--tls-key", str(pki.client.key)])
    assert code == 0


async def test_server_tls_without_client_certificates_when_asked(pki):
    """The gateway's --no-grpc-client-certs: TLS, but a caller without a certificate is served."""
    from tandem.rpc.endpoints import Health, bind, make_server

    security = mutual(pki, pki.target)
    server = make_server()
    health = Health(server, [])
    port = bind(server, "127.0.0.1", 0, security.server_credentials(client_certs=False))
    await server.start()
    await health.serving()
    try:
        anonymous = HopSecurity.from_settings(settings(tls_ca=str(pki.ca)))
        serving, seen = await asyncio.to_thread(healthcheck.check, f"localhost:{port}", "", 5, anonymous)
        assert serving, seen
        serving, seen = await asyncio.to_thread(healthcheck.check, f"localhost:{port}", "", 5, HopSecurity())
        assert not serving  # still TLS: plaintext fails
    finally:
        await server.stop(0)


def test_serve_hands_every_child_the_tls_flags_and_the_token_in_its_environment(pki):
    from tandem.config import ServeSettings
    from tandem.supervisor import child_commands

    serve = ServeSettings(tls_cert=str(pki.target.cert), tls_key=str(pki.target.key), tls_ca=str(pki.ca),
                          tls_server_name="tandem.internal", internal_token=TOKEN, targets=2, drafts=2,
                          http_tls_cert=str(pki.target.cert), http_tls_key=str(pki.target.key))
    children = child_commands(serve)
    assert [c.name for c in children] == ["target-0", "target-1", "draft-0", "draft-1", "gateway"]
    for child in children:
        argv = " ".join(child.argv)
        assert f"--tls-cert {pki.target.cert}" in argv and f"--tls-ca {pki.ca}" in argv, child.name
        assert "--tls-server-name tandem.internal" in argv
        assert TOKEN not in argv and child.env["TANDEM_INTERNAL_TOKEN"] == TOKEN
        assert ("--http-tls-cert" in argv) == (child.name == "gateway")

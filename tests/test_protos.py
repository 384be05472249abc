"""The committed stubs in tandem/v1 are exactly what ``python -m tandem.rpc.protogen`` makes."""

from __future__ import annotations

from pathlib import Path

from tandem.rpc import protogen


def test_stubs_match_protos(tmp_path: Path) -> None:
    generated = protogen.generate(tmp_path)
    committed_dir = protogen.REPO_ROOT / "tandem" / "v1"
    names = sorted(p.name for p in generated)
    assert names == sorted(p.name for p in committed_dir.iterdir() if p.is_file()), "stub files differ; run python -m tandem.rpc.protogen"
    for path in generated:
        committed = (committed_dir / path.name).read_text()
        assert committed == path.read_text(), f"{path.name} drifted from the protos; run python -m tandem.rpc.protogen"


def test_buf_style_names() -> None:
    """Versioned package, XxxService, XxxRequest/XxxResponse per RPC, enum zero = *_UNSPECIFIED."""
    from tandem.v1 import common_pb2, draft_pb2, gateway_pb2, target_pb2

    for module in (common_pb2, draft_pb2, gateway_pb2, target_pb2):
        descriptor = module.DESCRIPTOR
        assert descriptor.package == "tandem.v1"
        for service in descriptor.services_by_name.values():
            assert service.name.endswith("Service")
            for method in service.methods:
                assert method.input_type.name in (f"{method.name}Request", f"{service.name}{method.name}Request")
                assert method.output_type.name in (f"{method.name}Response", f"{service.name}{method.name}Response")
        for enum in descriptor.enum_types_by_name.values():
            assert enum.values[0].number == 0 and enum.values[0].name.endswith("_UNSPECIFIED")


def test_a_verdict_crosses_the_wire_with_its_pass() -> None:
    """A verdict's fields, the pass it was verified in included, survive the target's codec both ways."""
    from tandem.rpc import codecs
    from tandem.rpc.types import FinishReason, Verdict, VerdictStatus

    verdict = Verdict(block_id=7, status=VerdictStatus.OK, committed_len=12, num_accepted=2,
                      committed_token_ids=(4, 5, 6), finish_reason=FinishReason.NONE, verify_seconds=0.5,
                      pass_rows=25, pass_tokens=11, step_seconds=0.25)
    assert codecs.verdict(codecs.verdict_to_wire(verdict)) == verdict
    old = codecs.verdict(codecs.verdict_to_wire(Verdict(block_id=1, status=VerdictStatus.STALE)))
    assert (old.pass_rows, old.pass_tokens) == (0, 0)  # not reported: the draft prices its block alone
    assert old.step_seconds == 0.0  # not reported: the gateway falls back on what it times


def test_the_targets_price_of_a_step_reaches_the_gateway() -> None:
    """From a decode step and from a verdict (through the draft's round) to the gateway's batches."""
    from draft_service import wire as draft_wire
    from draft_service.types import FinishReason, RoundResult
    from gateway import wire as gateway_wire
    from target_service import wire as target_wire
    from target_service.types import GenerateResult

    step = GenerateResult((5,), 9, FinishReason.NONE, pass_seconds=0.0625, step_seconds=0.03125)
    batch = gateway_wire.batch_from_generate(target_wire.generate_response(step))
    assert (batch.token_ids, batch.pass_seconds, batch.step_seconds) == ((5,), 0.0625, 0.03125)
    round_ = RoundResult((5, 6), 10, FinishReason.NONE, 3, 1, 0.125, 0.0625, step_seconds=0.03125)
    batch = gateway_wire.batch_from_speculate(draft_wire.speculate_response(round_))
    assert (batch.verify_seconds, batch.step_seconds, batch.pass_seconds) == (0.0625, 0.03125, 0.0)

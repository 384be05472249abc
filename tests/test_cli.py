"""Flags, env twins and the serve supervisor's child commands, without starting anything."""

from __future__ import annotations

import pytest

from tandem import cli, config
from tandem.models import is_model_free_draft, resolve_draft_spec
from tandem.supervisor import child_commands, connect_host


def parse(*argv: str):
    args = cli.build_parser().parse_args(list(argv))
    return cli.settings_from(args, args.settings_cls)


def test_defaults_follow_the_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("TARGET_MODEL", "DRAFT_MODEL", "TANDEM_TARGET_MODEL", "TANDEM_DRAFT_MODEL", "TANDEM_HOST"):
        monkeypatch.delenv(var, raising=False)
    s = parse("serve")
    assert (s.target_model, s.draft_model, s.num_speculative_tokens) == ("gemma-3-270m", config.DEFAULT_DRAFT, config.DEFAULT_K)
    assert config.DEFAULT_DRAFT == "auto"
    # auto: lookup plus the head shipped for the default target; lookup alone for other targets.
    assert resolve_draft_spec("auto", "gemma-3-270m") == "ngram+eagle"
    assert resolve_draft_spec("auto", "/models/some-llama") == "ngram"
    assert resolve_draft_spec("ngram", "gemma-3-270m") == "ngram"
    assert is_model_free_draft("auto")
    assert 1 <= config.DEFAULT_K <= 8
    assert (s.host, s.http_port, s.grpc_port, s.draft_port, s.target_port) == ("127.0.0.1", 8000, 50051, 50052, 50053)
    assert (s.draft_metrics_port, s.target_metrics_port) == (9052, 9053)


def test_env_twins_and_flag_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_NUM_SPECULATIVE_TOKENS", "7")
    monkeypatch.setenv("TARGET_MODEL", "/models/a")
    monkeypatch.setenv("TANDEM_DRAFT_MODEL", "/models/b")
    s = parse("serve")
    assert (s.num_speculative_tokens, s.target_model, s.draft_model) == (7, "/models/a", "/models/b")
    s = parse("serve", "--num-speculative-tokens", "3", "--target-model", "/models/c")
    assert (s.num_speculative_tokens, s.target_model) == (3, "/models/c")


def test_invalid_flag_value_is_refused() -> None:
    with pytest.raises(Exception, match="num_speculative_tokens"):
        parse("serve", "--num-speculative-tokens", "0")


def test_children_talk_over_loopback_on_the_given_ports() -> None:
    s = config.ServeSettings(host="0.0.0.0", target_port=6001, draft_port=6002, grpc_port=6003, http_port=6004)
    target, draft, gateway = child_commands(s)
    assert target.argv[3] == "target" and "6001" in target.argv
    assert draft.argv[draft.argv.index("--target-address") + 1] == "127.0.0.1:6001"
    # The draft knows the target's SPEC: the eagle draft reads the target's embedding and head.
    assert draft.argv[draft.argv.index("--target-model") + 1] == s.target_model
    # The draft child gets the spec "auto" stands for, so its command line (and logs) say it.
    expected = "ngram+eagle" if s.target_model == "gemma-3-270m" and s.draft_model == "auto" else s.draft_model
    assert draft.argv[draft.argv.index("--draft-model") + 1] == expected
    assert gateway.argv[gateway.argv.index("--draft-address") + 1] == "127.0.0.1:6002"
    assert gateway.health_address == "127.0.0.1:6003"
    assert connect_host("10.0.0.5") == "10.0.0.5"
    # Every child command parses with the CLI's own parser.
    for child in (target, draft, gateway):
        parse(*child.argv[3:])

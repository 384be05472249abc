"""Flags, env twins and the serve supervisor's child commands, without starting anything."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tandem import cli, config, fleet
from tandem.models import is_model_free_draft, resolve_draft_spec
from tandem.supervisor import child_commands, connect_host, serve


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


def test_invalid_flag_value_is_refused_with_one_line_naming_the_flag(capsys) -> None:
    for argv, message in [(("serve", "--num-speculative-tokens", "0"), "--num-speculative-tokens: Input should be"),
                          (("gateway", "--target-address", "a:1,b"), "--target-address: Value error, address 'b' is "
                                                                      "not host:port"),
                          (("draft", "--target-address", "x:http"), "--target-address: Value error")]:
        with pytest.raises(SystemExit) as info:
            parse(*argv)
        assert info.value.code == 2
        assert message in capsys.readouterr().err


def test_an_unknown_flag_is_refused_by_its_command_with_the_closest_flags(capsys) -> None:
    for argv, said in [(["serve", "--port", "8000"], "tandem serve: error: unrecognized arguments: --port 8000 (did "
                                                     "you mean --http-port"),
                       (["gateway", "--target-adress=x:1"], "(did you mean --target-address"),
                       (["bench", "--promts", "3"], "tandem bench: error: unrecognized arguments: --promts 3 (did you "
                                                    "mean --prompts"),
                       (["draft", "--zzz"], "tandem draft: error: unrecognized arguments: --zzz\n")]:
        with pytest.raises(SystemExit) as info:
            cli.parse(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert said in err and err.startswith(f"usage: tandem {argv[0]}"), err
    assert cli.parse(["serve", "--http-port", "9"]).http_port == 9


def test_serve_starts_its_children_without_importing_torch() -> None:
    """``tandem serve`` parses its flags and starts the three children before anything imports torch
    or transformers (about 1.5 s here, which every start and every other command would pay first)."""
    script = ("import sys\nfrom tandem import cli\ncli.build_parser()\nimport tandem.supervisor\n"
              "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


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


def test_the_default_command_lines_are_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    """N = M = 1: the same three children, names and flags as before fleets existed."""
    for var in ("TARGET_MODEL", "DRAFT_MODEL", *(v for v in os.environ if v.startswith("TANDEM_"))):
        monkeypatch.delenv(var, raising=False)
    s = parse("serve")
    py = [sys.executable, "-m", "tandem.cli"]
    common = ["--host", "127.0.0.1", "--log-level", "info"]
    device = ["--device", "auto", "--dtype", "auto"]
    expected = [
        ("target", [*py, "target", *common, *device, "--target-model", "gemma-3-270m",
                    "--port", "50053", "--metrics-port", "9053"], "127.0.0.1:50053"),
        ("draft", [*py, "draft", *common, *device, "--draft-model", "ngram+eagle", "--target-model", "gemma-3-270m",
                   "--target-address", "127.0.0.1:50053", "--port", "50052", "--metrics-port", "9052",
                   "--num-speculative-tokens", str(config.DEFAULT_K)], "127.0.0.1:50052"),
        ("gateway", [*py, "gateway", *common, "--target-model", "gemma-3-270m", "--target-address", "127.0.0.1:50053",
                     "--draft-address", "127.0.0.1:50052", "--http-port", "8000", "--grpc-port", "50051",
                     "--num-speculative-tokens", str(config.DEFAULT_K), "--stream-smoothing", "auto"],
         "127.0.0.1:50051"),
    ]
    assert [(c.name, c.argv, c.health_address) for c in child_commands(s)] == expected


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_serve_hands_the_gateway_its_sampling_defaults_choice() -> None:
    gateway = child_commands(parse("serve", "--generation-config", "none"))[-1]
    assert flag(gateway.argv, "--generation-config") == "none"
    assert parse(*gateway.argv[3:]).generation_config == "none"
    with pytest.raises(SystemExit):
        parse("serve", "--generation-config", "vllm")


def test_a_fleet_of_three_targets_and_two_drafts() -> None:
    s = parse("serve", "--targets", "3", "--drafts", "2")
    children = {c.name: c for c in child_commands(s)}
    assert list(children) == ["target-0", "target-1", "target-2", "draft-0", "draft-1", "gateway"]  # start order
    targets = "127.0.0.1:50053,127.0.0.1:50055,127.0.0.1:50057"
    for i in range(3):
        argv = children[f"target-{i}"].argv
        assert argv[3] == "target"
        assert (flag(argv, "--port"), flag(argv, "--metrics-port")) == (str(50053 + 2 * i), str(9053 + 2 * i))
        assert children[f"target-{i}"].health_address == f"127.0.0.1:{50053 + 2 * i}"
    for j in range(2):
        argv = children[f"draft-{j}"].argv
        assert argv[3] == "draft"
        assert flag(argv, "--target-address") == targets  # one channel per target
        assert (flag(argv, "--port"), flag(argv, "--metrics-port")) == (str(50052 + 2 * j), str(9052 + 2 * j))
        assert children[f"draft-{j}"].health_address == f"127.0.0.1:{50052 + 2 * j}"
    gateway = children["gateway"].argv
    assert flag(gateway, "--target-address") == targets
    assert flag(gateway, "--draft-address") == "127.0.0.1:50052,127.0.0.1:50054"
    assert (flag(gateway, "--grpc-port"), flag(gateway, "--http-port")) == ("50051", "8000")
    ports = [int(flag(c.argv, p)) for c in children.values() for p in ("--port", "--metrics-port") if p in c.argv]
    assert len(set(ports + [50051, 8000])) == len(ports) + 2  # nobody shares a port
    for child in children.values():
        parse(*child.argv[3:])


def test_ports_two_children_would_share_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(fleet.FleetError, match="port 50055 would be used twice: by target-1 gRPC and draft-0 gRPC"):
        fleet.plan(parse("serve", "--targets", "2", "--draft-port", "50055"))
    with pytest.raises(fleet.FleetError, match="port 9055"):
        fleet.plan(parse("serve", "--targets", "2", "--draft-metrics-port", "9055"))
    with pytest.raises(fleet.FleetError, match="port 50051 .* gateway gRPC and target-0"):
        fleet.plan(parse("serve", "--drafts", "2", "--target-port", "50051"))
    with pytest.raises(fleet.FleetError, match="out of range"):
        fleet.plan(parse("serve", "--targets", "3", "--target-port", "65534"))
    # tandem serve refuses it before starting anything, with the reason, and exits non-zero.
    assert serve(parse("serve", "--targets", "2", "--draft-port", "50055")) != 0
    assert "50055 would be used twice" in capsys.readouterr().err
    # The command itself exits with that code (tandem.cli ends it without the interpreter's
    # teardown), its message written.
    done = subprocess.run([sys.executable, "-m", "tandem.cli", "serve", "--targets", "2", "--draft-port", "50055"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "50055 would be used twice" in done.stderr, done


def test_port_zero_picks_a_distinct_free_port_per_child() -> None:
    s = config.ServeSettings(targets=3, drafts=2, target_port=0, draft_port=0, grpc_port=0, http_port=0,
                             target_metrics_port=0, draft_metrics_port=0)
    planned = fleet.plan(s)
    grpc_ports = [m.port for m in (*planned.targets, *planned.drafts)] + [planned.grpc_port, planned.http_port]
    assert 0 not in grpc_ports and len(set(grpc_ports)) == len(grpc_ports)
    assert not set(grpc_ports) & {8000, 50051, 50052, 50053}
    assert all(m.metrics_port == 0 for m in (*planned.targets, *planned.drafts))  # 0 = metrics off, as per service
    children = {c.name: c for c in child_commands(s, planned)}
    assert flag(children["draft-1"].argv, "--target-address") == planned.target_addresses
    assert children["target-2"].health_address == f"127.0.0.1:{planned.targets[2].port}"
    # A fixed port stays where it was asked; only the 0s are picked, away from it.
    mixed = fleet.plan(config.ServeSettings(targets=2, target_port=0, draft_port=41000, grpc_port=41001, http_port=0))
    assert mixed.drafts[0].port == 41000 and mixed.grpc_port == 41001
    assert not {m.port for m in mixed.targets} & {41000, 41001}


def test_the_ready_block_lists_every_target_and_draft() -> None:
    s = config.ServeSettings(target_model="/models/llama", draft_model="ngram", num_speculative_tokens=5)
    assert fleet.ready_block(s, fleet.plan(s)) == (
        "\ntandem is ready\n"
        "  OpenAI API    http://127.0.0.1:8000/v1   (model: llama)\n"
        "  gateway gRPC  127.0.0.1:50051   (tandem.v1.GatewayService)\n"
        "  draft gRPC    127.0.0.1:50052   (ngram, K=5)\n"
        "  target gRPC   127.0.0.1:50053\n"
        "  metrics       http://127.0.0.1:8000/metrics  http://127.0.0.1:9052/metrics  http://127.0.0.1:9053/metrics\n"
        "Press Ctrl-C to stop.\n"
    )
    s = config.ServeSettings(target_model="/models/llama", draft_model="ngram", num_speculative_tokens=5,
                             targets=3, drafts=2, host="0.0.0.0")
    block = fleet.ready_block(s, fleet.plan(s))
    lines = block.splitlines()
    assert lines[1] == "tandem is ready" and lines[-1] == "Press Ctrl-C to stop."
    assert "  draft-1 gRPC   127.0.0.1:50054   (ngram, K=5)   metrics http://127.0.0.1:9054/metrics" in lines
    assert "  target-2 gRPC  127.0.0.1:50057   metrics http://127.0.0.1:9057/metrics" in lines
    assert fleet.read_ready_block(block) == {
        "http": "127.0.0.1:8000", "gateway": "127.0.0.1:50051", "draft-0": "127.0.0.1:50052",
        "draft-1": "127.0.0.1:50054", "target-0": "127.0.0.1:50053", "target-1": "127.0.0.1:50055",
        "target-2": "127.0.0.1:50057",
    }
    single = config.ServeSettings()
    assert fleet.read_ready_block(fleet.ready_block(single, fleet.plan(single))) == {
        "http": "127.0.0.1:8000", "gateway": "127.0.0.1:50051", "draft": "127.0.0.1:50052", "target": "127.0.0.1:50053"}


def test_a_service_given_a_model_that_names_nothing_exits_with_one_line() -> None:
    """``tandem target`` binds its port, then loads the model: a SPEC naming nothing ends it with
    the reason and exit code 2, not a traceback (gateway and draft alike, through tandem.cli)."""
    from tandem.tools.bench.stack import free_port

    done = subprocess.run([sys.executable, "-m", "tandem.cli", "target", "--target-model", "google/gemma-3-270m",
                           "--port", str(free_port()), "--metrics-port", "0"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "tandem target: model spec 'google/gemma-3-270m' is not a folder or file here" in done.stderr

"""The ``tandem`` command: one sub-command per service, ``serve`` (all three), and the tools
(``bench``, ``calibrate``, ``distill``).

Every flag has an env twin ``TANDEM_<FLAG>`` (pydantic-settings); a flag given on the command line
wins. Flags are generated from the settings classes, so a new setting is a new flag for free.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from typing import Any, NoReturn, get_args, get_origin

# No hub access at run time: every model comes from a local folder, a GGUF file or a package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pydantic import ValidationError  # noqa: E402
from pydantic_settings import BaseSettings  # noqa: E402

from tandem import config  # noqa: E402

# The name a service's log lines carry (set by tandem serve's supervisor for its children).
LOG_NAME_ENV = "TANDEM_LOG_NAME"


def _flag_type(annotation: Any) -> Any:
    if get_origin(annotation) is not None:  # Optional[X] / X | None
        args = [a for a in get_args(annotation) if a is not type(None)]
        annotation = args[0] if args else str
    return annotation if annotation in (int, float, str, bool) else str


def add_settings_flags(parser: argparse.ArgumentParser, settings_cls: type[BaseSettings]) -> None:
    """One ``--flag-name`` per settings field; absent flags leave the env / default in charge."""
    for name, field in settings_cls.model_fields.items():
        kind = _flag_type(field.annotation)
        default = field.default
        help_text = f"{field.description or ''} (env TANDEM_{name.upper()}; default {default!r})"
        flag = "--" + name.replace("_", "-")
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if extra.get("repeatable"):  # e.g. --api-key A --api-key B: the setting gets "A,B"
            parser.add_argument(str(extra["flag"]), dest=name, action="append", default=argparse.SUPPRESS,
                                help=f"{field.description or ''} (env TANDEM_{name.upper()})", metavar="VALUE")
            continue
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=help_text, metavar=name.upper())


def settings_from(args: argparse.Namespace, settings_cls: type[BaseSettings]) -> Any:
    """The settings of the flags given and the environment; a bad value exits with status 2 and
    one line per problem naming the flag, as argparse does for its own errors."""
    given = {k: ",".join(v) if isinstance(v, list) else v for k, v in vars(args).items()
             if k in settings_cls.model_fields}
    try:
        return settings_cls(**given)
    except ValidationError as exc:
        problems = "; ".join(f"--{'-'.join(str(p) for p in e['loc']).replace('_', '-')}: {e['msg']}"
                             for e in exc.errors())
        print(f"tandem {args.command}: error: {problems}", file=sys.stderr)
        raise SystemExit(2) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = {
        "serve": (config.ServeSettings, "run target, draft and gateway as three processes on loopback"),
        "target": (config.TargetSettings, "run the target service (verifies draft blocks)"),
        "draft": (config.DraftSettings, "run the draft service (proposes blocks, runs the loop)"),
        "gateway": (config.GatewaySettings, "run the gateway (OpenAI HTTP API and gRPC)"),
    }
    for name, (settings_cls, help_text) in commands.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_settings_flags(p, settings_cls)
        p.set_defaults(settings_cls=settings_cls, command_parser=p)
    tools = {
        "bench": "measure speculative against autoregressive decoding",
        "calibrate": "KL divergence and expected acceptance of a draft/target pair, recommended K",
        "distill": "train a draft (eagle head or standalone) for a target on the target's own outputs",
    }
    for name, help_text in tools.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        _tool_module(name).add_arguments(p)
        p.set_defaults(settings_cls=None, command_parser=p)
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; an unknown flag is refused by its command (its usage, not tandem's) with
    the closest flags it has, exit status 2."""
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        command: argparse.ArgumentParser = args.command_parser
        flags = [flag for action in command._actions for flag in action.option_strings]
        near = [match for token in unknown if token.startswith("--")
                for match in difflib.get_close_matches(token.split("=", 1)[0], flags, n=3, cutoff=0.6)]
        hint = f" (did you mean {', '.join(dict.fromkeys(near))}?)" if near else ""
        command.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    return args


def _tool_module(name: str) -> Any:
    """``tandem.tools.bench`` / ``tandem.tools.calibrate`` / ``tandem.tools.distill``: each has add_arguments and main."""
    import importlib

    return importlib.import_module(f"tandem.tools.{name}")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.settings_cls is None:
        return _tool_module(args.command).main(args)
    settings = settings_from(args, args.settings_cls)
    from tandem.telemetry.logs import setup_logging

    # Under `tandem serve --targets N`, the supervisor names each child (target-0, target-1, ...).
    setup_logging(os.environ.get(LOG_NAME_ENV) or args.command, settings.log_level)
    if args.command == "serve":
        from tandem.supervisor import serve

        _exit_now(serve(settings))
    if args.command == "target":
        from target_service.main import run
    elif args.command == "draft":
        from draft_service.main import run
    else:
        from gateway.main import run
    from tandem.models.specs import ModelSpecError

    try:
        run(settings)
    except ModelSpecError as refused:  # a model SPEC that names nothing loadable: one line, not a traceback
        print(f"tandem {args.command}: {refused}", file=sys.stderr, flush=True)
        _exit_now(2)
    _exit_now(0)


def _exit_now(code: int) -> NoReturn:
    """Ends a service (or ``tandem serve``) that has stopped cleanly, without the interpreter's teardown.

    By now the service has drained its requests, closed its servers and flushed its traces (a
    failure raised instead, and exits the usual way); what is left is freeing a loaded model's
    objects one by one, about a second per process, paid in turn by every role a ``tandem serve``
    stops. Logs and the standard streams are flushed first."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can reach it
            pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())

"""`tandem distill`: placeholder until the module lands in this session (replaced, not shipped)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def main(args: argparse.Namespace) -> int:
    raise SystemExit("tandem distill: not built yet")

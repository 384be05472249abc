"""Regenerates the Python gRPC stubs in ``tandem/v1`` from ``protos/tandem/v1/*.proto``.

Run ``python -m tandem.rpc.protogen`` after editing a proto. The stubs are committed so that an install
needs no code generator; ``tests/test_protos.py`` fails when they drift from the protos.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"
PROTO_DIR = PROTO_ROOT / "tandem" / "v1"


def generate(out_dir: Path) -> list[Path]:
    """Writes ``tandem/v1/*_pb2*.py(i)`` under ``out_dir``; returns the written files."""
    from grpc_tools import protoc  # imported lazily: a dev dependency only

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_DIR.glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    pkg = out_dir / "tandem" / "v1"
    init = pkg / "__init__.py"
    init.write_text('"""Generated gRPC stubs for package tandem.v1 (python -m tandem.rpc.protogen)."""\n')
    return sorted(p for p in pkg.iterdir() if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="output root (default: repo)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

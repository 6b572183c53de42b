"""Generate the Python stubs of protos/ (``make protos``); ``--check`` fails when they are stale.

Usage: gen_protos.py PROTO_ROOT OUT_DIR [--check]
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

import grpc_tools
from grpc_tools import protoc


def generate(proto_root: Path, out_dir: Path) -> None:
    protos = sorted(str(p.relative_to(proto_root)) for p in proto_root.glob("opml/**/*.proto"))
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{proto_root}", f"-I{well_known}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {proto_root}")


def stale_files(expected: Path, actual: Path) -> list[str]:
    """Relative paths that differ, are missing, or are extra in ``actual``."""
    def stubs(root: Path) -> set[Path]:  # generated sources only: Python's bytecode caches are not stubs
        return {p for pattern in ("*.py", "*.pyi") for p in root.rglob(pattern) if "__pycache__" not in p.parts}

    exp = {p.relative_to(expected) for p in stubs(expected)}
    act = {p.relative_to(actual) for p in stubs(actual / "opml")}
    diff = sorted(str(p) for p in exp ^ act)
    diff += sorted(str(p) for p in exp & act if not filecmp.cmp(expected / p, actual / p, shallow=False))
    return diff


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("proto_root", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            generate(args.proto_root, Path(tmp))
            stale = stale_files(Path(tmp), args.out_dir)
        if stale:
            print("generated stubs are stale (run `make protos`):", *stale, sep="\n  ")
            return 1
        print("generated stubs are up to date")
        return 0
    shutil.rmtree(args.out_dir / "opml", ignore_errors=True)
    generate(args.proto_root, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())

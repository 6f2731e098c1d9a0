"""Regenerate the Python stubs of every .proto in this folder (`make protos`).

`python -m protos.generate --check` regenerates into a scratch folder and exits
non-zero when the committed stubs differ, which is what the staleness test runs.
"""
from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent
ROOT = PROTO_DIR.parent
STUB_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_root: Path = ROOT) -> list[Path]:
    """Run protoc on every proto; stubs land in `out_root`/protos/ and import as `protos.*`."""
    protos = sorted(PROTO_DIR.glob("*.proto"))
    (out_root / PROTO_DIR.name).mkdir(parents=True, exist_ok=True)
    for proto in protos:
        args = ["protoc", f"-I{ROOT}", f"--python_out={out_root}", f"--pyi_out={out_root}",
                f"--grpc_python_out={out_root}", str(proto.relative_to(ROOT))]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")
    return [out_root / PROTO_DIR.name / (p.stem + s) for p in protos for s in STUB_SUFFIXES]


def stale_stubs() -> list[str]:
    """Names of committed stubs that differ from what the current protos generate."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        return [f.name for f in fresh
                if not (PROTO_DIR / f.name).exists()
                or not filecmp.cmp(f, PROTO_DIR / f.name, shallow=False)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="only report stale stubs")
    if parser.parse_args().check:
        stale = stale_stubs()
        if stale:
            print("stale generated stubs (run `make protos`):", ", ".join(stale), file=sys.stderr)
        return 1 if stale else 0
    for path in generate():
        print("wrote", path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Generate the Python stubs for proto/*.proto (`make proto`); the stubs are checked in.

    python proto/generate.py [OUT_DIR]     # default: the repository root (writes proto/*_pb2*.py{,i})

Run from anywhere; the .proto files are compiled with the repository root on the include
path, so the stubs import each other as `proto.pdserve_pb2`.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTOS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "proto").glob("*.proto"))


def generate(out_dir: str | Path = ROOT) -> list[Path]:
    import grpc_tools
    from grpc_tools import protoc

    out = Path(out_dir)
    (out / "proto").mkdir(parents=True, exist_ok=True)
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *PROTOS,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {', '.join(PROTOS)}")
    return sorted(p for p in (out / "proto").iterdir() if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")))


if __name__ == "__main__":
    for p in generate(sys.argv[1] if len(sys.argv) > 1 else ROOT):
        print(p)

"""Builds the pdserve CPU operators (kernels/csrc/*.cpp) into kernels/_ops/ with
torch.utils.cpp_extension, recording a digest of the sources and the torch version, which
kernels/cpu_ops.py checks before loading. `make` and the CPU image's build stage run it; nothing
builds at run time.

    python -m kernels.build [--march native]"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

__all__ = ["CSRC", "LIB", "META", "NAME", "build", "source_digest"]

NAME = "pdserve_cpu_ops"
CSRC = Path(__file__).with_name("csrc")
OPS_DIR = Path(__file__).with_name("_ops")
LIB = OPS_DIR / f"{NAME}.so"
META = OPS_DIR / f"{NAME}.json"
COMMAND = "python -m kernels.build"  # what the loader's warning tells a user to run


def _sources() -> list[Path]:
    return sorted(CSRC.glob("*.cpp"))


def source_digest() -> str:
    """sha256 over the C++ sources and headers (names and bytes), first 16 hex digits."""
    h = hashlib.sha256()
    for p in sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.h")]):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def build(march: str = "native", verbose: bool = False) -> Path:
    """Compiles the operators for `march` (a gcc -march value: native for this machine,
    x86-64-v3 for any AVX2 machine) and returns the library's path."""
    from torch.utils import cpp_extension

    build_dir = OPS_DIR / "build"
    build_dir.mkdir(parents=True, exist_ok=True)
    digest = source_digest()
    # -ffp-contract=fast: multiply-adds fuse as they did under gnu C (ISO C++ modes turn it off)
    flags = ["-O3", f"-march={march}", "-ffp-contract=fast", "-fopenmp", "-Wno-vla"]
    cpp_extension.load(
        name=NAME,
        sources=[str(p) for p in _sources()],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(CSRC)],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=verbose,
    )
    tmp = LIB.with_suffix(".so.tmp")
    shutil.copyfile(build_dir / f"{NAME}.so", tmp)
    os.replace(tmp, LIB)  # atomic: a process loading it sees the old file or the new one
    META.write_text(json.dumps({"sources": digest, "torch": torch.__version__, "march": march}, indent=1) + "\n")
    return LIB


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    ap.add_argument("--march", default=os.environ.get("PDSERVE_MARCH", "native"), help="gcc -march (default native)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    print(f"built {build(args.march, args.verbose)}")


if __name__ == "__main__":
    main()

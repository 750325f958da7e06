"""The checked-in stubs match proto/*.proto (regenerate with `make proto`)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load_descriptor(path: Path) -> bytes:
    m = re.search(rb"AddSerializedFile\((b'.*?')\)\n", path.read_bytes(), re.S)
    assert m, f"no serialized descriptor in {path}"
    return eval(m.group(1))  # a bytes literal written by protoc


def _version(path: Path, pattern: str) -> str | None:
    m = re.search(pattern, path.read_text())
    return m.group(1) if m else None


def test_checked_in_stubs_are_fresh(tmp_path):
    # protoc runs in a child process: grpc_tools' compiler and NIXL's native libraries crash when
    # loaded into one process (either order), and the test session loads NIXL elsewhere.
    r = subprocess.run(
        [sys.executable, str(ROOT / "proto" / "generate.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    fresh = sorted(
        p for p in (tmp_path / "proto").iterdir() if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))
    )
    assert fresh, "nothing generated"
    # Byte-identical when this machine's protoc / grpc plugin wrote the checked-in files too;
    # otherwise the wire schema (the serialized descriptor) must still be identical.
    same_tools = True
    for new in fresh:
        old = ROOT / "proto" / new.name
        assert old.is_file(), f"{old} is missing: run `make proto` and commit the stubs"
        for pat in (r"GRPC_GENERATED_VERSION = '([^']+)'", r"Protobuf Python Version: (\S+)"):
            same_tools &= _version(new, pat) == _version(old, pat)
        if new.name.endswith("_pb2.py"):
            assert _load_descriptor(new) == _load_descriptor(old), f"{old.name} is stale: run `make proto`"
    if same_tools:
        for new in fresh:
            old = ROOT / "proto" / new.name
            assert new.read_text() == old.read_text(), f"{old.name} is stale: run `make proto`"


def test_every_service_has_health_and_reflection_names():
    from proto import pb

    assert set(pb.DESCRIPTOR.services_by_name) == {"Generation", "Registry", "DecodeNode", "PrefillNode", "EncodeNode"}
    assert pb.DESCRIPTOR.package == "pdserve.v1"

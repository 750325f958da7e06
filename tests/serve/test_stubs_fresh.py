"""The checked-in stubs match proto/*.proto (regenerate with `make proto`)."""

from __future__ import annotations

import importlib.util
import re
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
    spec = importlib.util.spec_from_file_location("proto_generate", ROOT / "proto" / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fresh = gen.generate(tmp_path)
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

    assert set(pb.DESCRIPTOR.services_by_name) == {"Generation", "Registry", "DecodeNode", "PrefillNode"}
    assert pb.DESCRIPTOR.package == "pdserve.v1"

"""Imports go one way (docs/ARCHITECTURE.md): kernels -> engine -> transfer -> serving ->
prefill_node / decode_node / encode_node -> router. proto is the wire alone and imports nothing of the project;
the engine imports only kernels; the node packages never import each other; the client
speaks proto and takes its credentials from serving.security, nothing else. Read from the source
with `ast`, so an import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (
    "kernels",
    "engine",
    "transfer",
    "serving",
    "encode_node",
    "prefill_node",
    "decode_node",
    "router",
    "client",
    "proto",
)
# package -> the first-party packages it may import (besides itself)
ALLOWED = {
    "proto": set(),
    "kernels": set(),
    "engine": {"kernels"},
    "transfer": {"kernels", "engine"},
    "serving": {"kernels", "engine", "transfer", "proto"},
    "prefill_node": {"kernels", "engine", "transfer", "serving", "proto"},
    "encode_node": {"kernels", "engine", "transfer", "serving", "proto"},
    "decode_node": {"kernels", "engine", "transfer", "serving", "proto"},
    "client": {"proto", "serving"},
    "router": set(PACKAGES),  # the top (its `pdserve generate` command uses the client SDK)
}
# modules of an allowed package that a package may still not reach past
CLIENT_MAY_IMPORT = {"proto", "serving.security"}


def _imports(path: Path) -> set[str]:
    """Dotted first-party modules `path` imports (absolute imports only; the project uses no others)."""
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return {m for m in out if m.split(".")[0] in PACKAGES}


def _sources(pkg: str) -> list[Path]:
    return sorted((ROOT / pkg).rglob("*.py"))


@pytest.mark.parametrize("pkg", PACKAGES)
def test_imports_go_one_way(pkg):
    bad = [
        f"{f.relative_to(ROOT)} imports {dep}"
        for f in _sources(pkg)
        for dep in sorted(_imports(f))
        if dep.split(".")[0] not in ALLOWED[pkg] | {pkg}
    ]
    assert not bad, "\n".join(bad)


def test_client_takes_only_the_wire_and_credentials():
    bad = [
        f"{f.relative_to(ROOT)} imports {dep}"
        for f in _sources("client")
        for dep in sorted(_imports(f))
        if dep.split(".")[0] != "client" and dep not in CLIENT_MAY_IMPORT and not dep.startswith("proto.")
    ]
    assert not bad, "\n".join(bad)


def test_proto_is_the_wire_alone():
    """The .proto, its stubs, the script that makes them and the one converter module."""
    allowed = {"__init__.py", "generate.py", "convert.py", "pdserve.proto", "pdserve_pb2.py", "pdserve_pb2.pyi",
               "pdserve_pb2_grpc.py"}  # fmt: skip
    extra = sorted(p.name for p in (ROOT / "proto").iterdir() if p.is_file() and p.name not in allowed)
    assert not extra, f"proto/ holds the wire only; move {extra} to serving/"


def test_nodes_leave_the_transfer_to_the_connector():
    """No node server drives transfer ranks itself or installs a hook into the engine."""
    bad = []
    for pkg in ("prefill_node", "decode_node", "encode_node"):
        for f in _sources(pkg):
            text = f.read_text()
            if "call_all(" in text:
                bad.append(f"{f.relative_to(ROOT)} calls executor.call_all")
            for hook in ("on_schedule", "on_output", "on_change"):
                if f".{hook} =" in text:
                    bad.append(f"{f.relative_to(ROOT)} assigns an engine hook ({hook})")
    assert not bad, "\n".join(bad)

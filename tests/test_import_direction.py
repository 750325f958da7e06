"""Imports go one way (docs/ARCHITECTURE.md): kernels -> engine -> transfer -> prefill_node /
decode_node -> router; the two node packages never import each other; the client speaks only
proto. Read from the source with `ast`, so an import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "engine", "transfer", "prefill_node", "decode_node", "router", "client", "proto")
# package -> the first-party packages it must not import
FORBIDDEN = {
    "kernels": {"engine", "transfer", "prefill_node", "decode_node", "router", "client", "proto"},
    "engine": {"transfer", "prefill_node", "decode_node", "router", "client", "proto"},
    "transfer": {"prefill_node", "decode_node", "router", "client", "proto"},
    "prefill_node": {"decode_node", "router", "client"},
    "decode_node": {"prefill_node", "router", "client"},
    "proto": {"prefill_node", "decode_node", "router", "client"},
    "client": {"kernels", "engine", "transfer", "prefill_node", "decode_node", "router"},
    "router": set(),  # the top (its `pdserve generate` command uses the client SDK)
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out & set(PACKAGES)


@pytest.mark.parametrize("pkg", PACKAGES)
def test_imports_go_one_way(pkg):
    bad = [
        f"{f.relative_to(ROOT)} imports {dep}"
        for f in sorted((ROOT / pkg).rglob("*.py"))
        for dep in sorted(_imports(f) & FORBIDDEN[pkg])
    ]
    assert not bad, "\n".join(bad)

"""`pdserve nodes`: the router's view of its nodes as a table, and one line with exit status 2
when the router cannot be reached; against a `pdserve up` that made its own cluster token, one
line saying where to give the token, then the table with the file `up` printed."""

from __future__ import annotations

import os
import subprocess
import sys

from proto import pb
from tests.helpers.serve_harness import ROOT, Up


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_CLUSTER_TOKEN"}
    return subprocess.run(
        [sys.executable, "-m", "router.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env
    )


def test_nodes_table_and_unreachable_router():
    from router.server import RouterConfig, serve

    # the fake nodes never heartbeat: keep them alive for the whole test, however slow the machine
    r, port = serve("127.0.0.1:0", RouterConfig(dead_after_s=600.0))
    try:
        out = _run("nodes", "--addr", f"127.0.0.1:{port}")
        assert out.returncode == 0 and "no node has registered" in out.stdout
        cap = pb.Capacity(total_blocks=100, free_blocks=40, block_size=16, total_slots=8, free_slots=3, running=5)
        r.registry.register(
            pb.NodeInfo(
                node_id="decode-7",
                kind=pb.NODE_KIND_DECODE,
                address="10.0.0.1:50062",
                incarnation=1,
                tp_size=2,
                capacity=cap,
            )
        )
        p = r.registry.register(
            pb.NodeInfo(
                node_id="prefill-3", kind=pb.NODE_KIND_PREFILL, address="10.0.0.2:50061", incarnation=1, tp_size=1
            )
        )
        r.registry.mark_draining(p)
        out = _run("nodes", "--addr", f"127.0.0.1:{port}")
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].split()[:4] == ["node", "kind", "address", "state"]
        rows = {ln.split()[0]: ln.split() for ln in lines[1:]}
        assert rows["decode-7"][1:7] == ["decode", "10.0.0.1:50062", "up", "2", "40/100", "3/8"]
        assert rows["prefill-3"][1:4] == ["prefill", "10.0.0.2:50061", "draining"]
    finally:
        r.stop(0)
    out = _run("nodes", "--addr", f"127.0.0.1:{port}", "--wait", "1")
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and "UNAVAILABLE" in out.stderr, out.stderr


def test_nodes_against_up_with_the_token_it_made(ckpt):
    up = Up("--model", ckpt, "--dtype", "float32", "--decode", "1", "--prefill", "1", env={"PDSERVE_CLUSTER_TOKEN": ""})
    try:
        path = up.find(r"pdserve up: cluster token in (\S+) ")
        assert os.stat(path).st_mode & 0o077 == 0  # the owner's alone
        out = _run("nodes", "--addr", str(up.address), "--wait", "10")
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert "UNAUTHENTICATED" in out.stderr and "--cluster-token-file" in out.stderr
        out = _run("nodes", "--addr", str(up.address), "--cluster-token-file", path, "--wait", "10")
        rows = {ln.split()[0]: ln.split() for ln in out.stdout.splitlines()[1:]}
        assert out.returncode == 0 and rows["decode-0"][3] == rows["prefill-0"][3] == "up", out
    finally:
        assert up.stop() == 0, up.output()
    assert not os.path.exists(path)  # gone with the cluster

"""Helpers for the serving tests: `pdserve up` as a subprocess, registry and node queries, waits."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from router.child_env import launch_env
from tests.helpers import hybrid_ckpt as hc

ROOT = Path(__file__).resolve().parents[2]
SPEC = dataclasses.replace(hc.SPEC_HV2, tokenizer=True)
# Every process a test starts joins the cluster with this token (PDSERVE_CLUSTER_TOKEN); the
# helpers below call the node plane with it.
CLUSTER_TOKEN = "serve-tests-cluster-token"


LENS = (1, 3, 64, 65, 200)
NEW = 16
BLOCK = 16  # --block-size of the clusters that check transfer byte counts


def flags(**options) -> list[str]:
    """Command-line flags from keywords, in order: flags(block_size=16) == ["--block-size", "16"]."""
    return [arg for name, value in options.items() for arg in ("--" + name.replace("_", "-"), str(value))]


class Proc:
    """`python -m router.cli ARGS` (any `pdserve` command) as a subprocess; its output is
    collected by a reader thread. Ready when a line matches `ready` (its first group is kept);
    the constructor waits for that unless `wait` is False (then call `wait_ready`). Start it from
    the thread that outlives it: the child gets SIGTERM when the thread that started it ends."""

    def __init__(
        self, *args: str, ready: str, timeout: float = 180.0, env: dict[str, str] | None = None, wait: bool = True
    ):
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "PDSERVE_LOG": "INFO",
            "PDSERVE_CLUSTER_TOKEN": CLUSTER_TOKEN,
            **(env or {}),
            **launch_env(),  # a killed test run takes its processes down with it
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._pattern = re.compile(ready)
        self._ready = threading.Event()
        self.address: str | None = None
        self._what = args[0]
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if wait:
            self.wait_ready(timeout)

    def wait_ready(self, timeout: float = 180.0) -> None:
        if not self._ready.wait(timeout) or self.address is None:
            self.stop()
            raise RuntimeError(f"`pdserve {self._what}` did not become ready:\n" + self.output())

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            m = self._pattern.search(line)
            if m and self.address is None:
                self.address = m.group(1)
                self._ready.set()
        self._ready.set()  # exited

    def output(self) -> str:
        return "".join(self.lines[-200:])

    def find(self, pattern: str, timeout: float = 20.0) -> str:
        """The first group of the first output line matching pattern (waits for it)."""
        rx = re.compile(pattern)
        return wait_for(
            lambda: next((m.group(1) for ln in list(self.lines) if (m := rx.search(ln))), None), timeout, pattern
        )

    def stop(self, timeout: float = 90.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise
        self._reader.join(5)  # its last lines (a child holding the pipe open keeps it no longer)
        return rc


class Up(Proc):
    """`pdserve up --port 0 ...`; ready at "pdserve up: ready at ADDR"."""

    def __init__(self, *args: str, timeout: float = 180.0, env: dict[str, str] | None = None):
        super().__init__("up", "--port", "0", *args, ready=r"pdserve up: ready at (\S+)", timeout=timeout, env=env)


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            kids.setdefault(ppid, []).append(int(d))
    return kids


def descendants(pid: int) -> set[int]:
    kids, out, todo = _children(), set(), [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _is_node(pid: int, node_id: str) -> bool:
    """A spawned node has --node-id in its command line; a forked one (router/node_forks.py) its
    name as comm, and the command line when the launcher's could be written over."""
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        comm = open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        return False
    return f"--node-id\0{node_id}\0".encode() in cmd or comm == node_id


def node_pid(up: Up, node_id: str) -> int:
    """The process of one node `up` started (not its TP workers, nor a child that kept its name)."""
    found = [p for p in descendants(up.proc.pid) if _is_node(p, node_id)]
    kids = _children()
    top = [p for p in found if not any(p in kids.get(q, ()) for q in found)]
    assert len(top) == 1, f"{node_id}: processes {found}"
    return top[0]


def nodes(address: str, c=None):
    from proto import pb, rpc
    from serving.rpc import channel

    with channel(address, c or creds()) as ch:
        return list(rpc.RegistryStub(ch).ListNodes(pb.ListNodesRequest(), timeout=10).nodes)


def decode_stats(node_address: str, c=None):
    from proto import pb, rpc
    from serving.rpc import channel

    with channel(node_address, c or creds()) as ch:
        return rpc.DecodeNodeStub(ch).Stats(pb.StatsRequest(), timeout=10)


def prefill_stats(node_address: str):
    from proto import pb, rpc
    from serving.rpc import channel

    with channel(node_address, creds()) as ch:
        return rpc.PrefillNodeStub(ch).Stats(pb.StatsRequest(), timeout=10)


def creds(tls=None):
    """What the tests call the node plane with: the cluster token (and TLS when given)."""
    from serving.security import Credentials

    return Credentials(cluster_token=CLUSTER_TOKEN.encode(), tls=tls)


def wait_for(pred, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def log_url(up: Proc, pattern: str) -> str:
    """The first group of the first output line matching pattern (a URL a server logged)."""
    return up.find(pattern, 20)


def scrape(url: str) -> dict[tuple, float]:
    """A /metrics page: {(sample name, sorted labels): value}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def node_info(address: str, node_id: str, c=None):
    """The router's NodeInfo of one node."""
    return next(n.node for n in nodes(address, c) if n.node.node_id == node_id)


def check_disaggregated_greedy(model: str, ps, want, a: int, b: int, requests: int, what: str = "", then=None) -> None:
    """`pdserve up` with one prefill node at TP a and one decode node at TP b, every prompt through
    the transfer: `greedy_through_transfer`; then `then(address)`, when given, on the same cluster."""
    pooled = flags(local_prefill_threshold=0, local_resume_threshold=0)  # every prompt through the transfer
    up = Up("--model", model, *flags(dtype="float32", prefill=1, decode=1, prefill_tp=a, decode_tp=b), *pooled,
            "--block-size", str(BLOCK))  # fmt: skip
    try:
        assert node_info(up.address, "decode-0").tp_size == b and node_info(up.address, "prefill-0").tp_size == a
        greedy_through_transfer(up.address, ps, want, requests, f"{what}tp {a} -> {b}: ")
        if then is not None:
            then(up.address)
    finally:
        rc = up.stop()
    assert rc == 0, up.output()


def greedy_through_transfer(address: str, ps, want, requests: int, what: str = "", node_creds=None, **client_kw):
    """On a cluster of one prefill and one decode node: `requests` concurrent greedy SDK calls
    (`Client(address, **client_kw)`) over the prompts `ps` give `want`, each prefilled on the
    prefill node with bytes moved, and the decode node's memory comes back."""
    from concurrent.futures import ThreadPoolExecutor

    from client import Client

    d = node_info(address, "decode-0", node_creds)
    initial = decode_stats(d.address, node_creds).capacity
    with Client(address, timeout=180, **client_kw) as c:
        c.wait_ready(timeout=90)
        jobs = [i % len(ps) for i in range(requests)]

        def one(i):  # no admission budget: a loaded runner's slow prefill estimate refused one (730 tokens at 24/s)
            return c.generate(
                prompt_token_ids=ps[i], max_tokens=len(want[i]), temperature=0.0, ignore_eos=True, admission_timeout_s=0
            )

        with ThreadPoolExecutor(requests) as ex:
            outs = list(ex.map(one, jobs))
    for i, r in zip(jobs, outs, strict=True):
        assert r.token_ids == want[i], f"{what}prompt of {len(ps[i])} tokens"
        assert r.prefill_node == "prefill-0" and r.transfer_bytes > 0
    wait_for(lambda: decode_stats(d.address, node_creds).capacity == initial, 30, "the decode node's memory back")


def state_bytes(model: str, block_size: int = BLOCK) -> tuple[int, int]:
    """(bytes of one KV page over every full-attention layer, bytes of one request's GDN state over
    every GDN layer) of a float32 checkpoint, from transformers' config of it."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model)
    t = getattr(c, "text_config", c)
    full = sum(k == "full_attention" for k in t.layer_types)
    gdn = len(t.layer_types) - full
    hk, hv, dk, dv = t.linear_num_key_heads, t.linear_num_value_heads, t.linear_key_head_dim, t.linear_value_head_dim
    conv = (2 * hk * dk + hv * dv) * (t.linear_conv_kernel_dim - 1)
    return full * 2 * t.num_key_value_heads * block_size * t.head_dim * 4, gdn * (conv + hv * dk * dv) * 4


def check_decode_prefix_reuse(model: str, address: str, new: int = NEW, block_size: int = BLOCK) -> tuple[list, list]:
    """A two-turn conversation on a cluster with one decode node: both turns give transformers'
    greedy tokens, and the second moves only the pages after the first turn's full pages of prompt
    and reply (the decode node holds those in its prefix cache: every position it computed, the
    reply's last token excepted) and the GDN state. Returns the two prompts."""
    from client import Client
    from tests.helpers import hybrid_ckpt as hc

    page, state = state_bytes(model, block_size)
    turn1 = hc.prompts(lens=(2 * block_size + 5,), seed=11)[0]  # two full pages and a partial one
    with Client(address, timeout=180) as c:
        c.wait_ready(timeout=90)
        r1 = c.generate(prompt_token_ids=turn1, max_tokens=new, temperature=0.0, ignore_eos=True)
        turn2 = turn1 + r1.token_ids + hc.prompts(lens=(block_size + 3,), seed=12)[0]
        r2 = c.generate(prompt_token_ids=turn2, max_tokens=new, temperature=0.0, ignore_eos=True)
    assert r1.token_ids == hc.hf_greedy(model, turn1, new)
    assert r2.token_ids == hc.hf_greedy(model, turn2, new)
    assert r1.prefill_node == r2.prefill_node == "prefill-0"
    assert r1.transfer_bytes == -(-len(turn1) // block_size) * page + state  # nothing cached yet
    fresh = -(-len(turn2) // block_size) - (len(turn1) + new - 1) // block_size
    assert r2.transfer_bytes == fresh * page + state, f"{fresh} new pages of {page} B and {state} B of GDN state"
    return turn1, turn2


def two_routers(model: str, procs: list[Proc]) -> tuple[Proc, Proc]:
    """Two routers, and a prefill and a decode node registered with both (`--router A,B`); every
    process is appended to `procs` (the caller stops them). The routers declare a node dead after
    30 s without a heartbeat: the callers kill routers, never nodes, and on a loaded box a node's
    heartbeats lapsed past the 3 s default (the request failed UNAVAILABLE, or the other router's
    pushes found the node's agents dropped)."""
    ra, rb = (
        Proc("router", "--port", "0", "--model", model, "--dead-after", "30", ready=r"router listening on (\S+)")
        for _ in "ab"
    )
    procs += [ra, rb]
    both = f"{ra.address},{rb.address}"
    for kind in ("prefill", "decode"):
        ready = rf"{kind} node \S+ listening on (\S+)"
        procs.append(Proc(kind, "--model", model, *flags(dtype="float32", router=both), ready=ready))
    for r in (ra, rb):
        wait_for(
            lambda r=r: {n.node.node_id for n in nodes(r.address) if n.alive} == {"prefill-0", "decode-0"},
            60,
            f"both nodes registered with {r.address}",
        )
    return ra, rb

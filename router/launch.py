"""`pdserve up`: a router and node pools as local processes.

Each child is `python -m router.cli <component> ...` in its own process group (so a TP node's
worker processes go down with it), and asks the kernel for SIGTERM should `up` itself die
(PR_SET_PDEATHSIG), so no child outlives it. Start-up order: the router (it reports its port
through a file, so `--port 0` works), then every node pointed at it; ready when every node
has registered. `stop()` sends SIGTERM to every group (each component drains: what is in flight
finishes, for at most `drain_timeout_s`; TP worker processes ignore it and follow their node),
waits, then SIGKILLs what is left.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


@dataclass
class PoolSpec:
    """What `up` launches (from the command line or a pools file)."""

    model: str
    prefill: int = 1
    decode: int = 1
    prefill_tp: int = 1
    decode_tp: int = 1
    host: str = "127.0.0.1"
    port: int = 50051
    dtype: str = "auto"
    device: str = "cpu"
    kv_cache_memory: str = "256MiB"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # every node's engine step budget (prompt tokens per step)
    local_prefill_threshold: int = 0
    policy: str = "least-loaded"
    admission_timeout_s: float = 30.0
    max_queued_requests: int = 512  # the router's --max-queued-requests
    prefill_window_tokens: int = 8192  # the router's --prefill-window-tokens
    reservation_lease_s: float = 15.0  # the router's --reservation-lease
    max_prefill_queue_tokens: int = 0  # the router's --max-prefill-queue-tokens
    num_speculative_tokens: int = 0  # every node's --num-speculative-tokens
    speculative_method: str = "ngram"  # every node's --speculative-method: ngram | mtp
    log_level: str = "INFO"
    transfer_backend: str = "nixl"
    http_port: int | None = None  # the router's OpenAI-compatible HTTP port (None: off)
    metrics_port: int | None = None  # the router's /metrics port; nodes then serve theirs on free ports
    drain_timeout_s: float = 30.0  # every component's --drain-timeout
    extra_decode_args: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.decode < 1:
            raise ValueError(f"need at least one decode node (got --decode {self.decode})")
        if self.prefill < 0:
            raise ValueError(f"--prefill must be >= 0 (got {self.prefill})")


class Cluster:
    def __init__(self, spec: PoolSpec, out=sys.stdout, should_stop=lambda: False):
        self.spec = spec
        self.should_stop = should_stop  # checked while waiting: a signal during start-up
        self.out = out
        self.procs: dict[str, subprocess.Popen] = {}
        self.port: int | None = None
        self._reported: set[str] = set()
        self._tmp = tempfile.TemporaryDirectory(prefix="pdserve-up-")

    @property
    def address(self) -> str:
        return f"{self.spec.host}:{self.port}"

    def node_ids(self) -> list[str]:
        s = self.spec
        return [f"prefill-{i}" for i in range(s.prefill)] + [f"decode-{i}" for i in range(s.decode)]

    def _spawn(self, name: str, args: list[str]) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        cmd = [sys.executable, "-m", "router.cli", "--log-level", self.spec.log_level, *args,
               "--drain-timeout", str(self.spec.drain_timeout_s)]  # fmt: skip
        self.procs[name] = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=die_with_parent)

    def start(self, ready_timeout: float = 300.0) -> None:
        s = self.spec
        port_file = Path(self._tmp.name) / "router.port"
        self._spawn(
            "router",
            ["router", "--host", s.host, "--port", str(s.port), "--port-file", str(port_file), "--model", s.model,
             "--policy", s.policy, "--admission-timeout", str(s.admission_timeout_s),
             "--max-queued-requests", str(s.max_queued_requests),
             "--prefill-window-tokens", str(s.prefill_window_tokens),
             "--reservation-lease", str(s.reservation_lease_s),
             "--max-prefill-queue-tokens", str(s.max_prefill_queue_tokens), *self._router_ports()],
        )  # fmt: skip
        deadline = time.monotonic() + ready_timeout
        while not (port_file.is_file() and port_file.read_text().strip()):
            self._check_children(deadline)
            time.sleep(0.05)
        self.port = int(port_file.read_text())
        for i in range(s.prefill):
            self._spawn_node("prefill", i, s.prefill_tp)
        for i in range(s.decode):
            self._spawn_node("decode", i, s.decode_tp,
                             "--local-prefill-threshold", str(s.local_prefill_threshold), *s.extra_decode_args)
        self._wait_registered(deadline)

    def _router_ports(self) -> list[str]:
        s, out = self.spec, []
        if s.http_port is not None:
            out += ["--http-port", str(s.http_port)]
        if s.metrics_port is not None:
            out += ["--metrics-port", str(s.metrics_port)]
        return out

    def _spawn_node(self, kind: str, i: int, tp: int, *extra: str) -> None:
        s = self.spec
        metrics = [] if s.metrics_port is None else ["--metrics-port", "0"]  # the router's port is fixed
        self._spawn(
            f"{kind}-{i}",
            [kind, "--model", s.model, "--router", self.address, "--host", s.host, "--port", "0",
             "--node-id", f"{kind}-{i}", "--tp", str(tp), "--dtype", s.dtype, "--device", s.device,
             "--kv-cache-memory", s.kv_cache_memory, "--max-num-seqs", str(s.max_num_seqs),
             "--max-num-batched-tokens", str(s.max_num_batched_tokens),
             "--transfer-backend", s.transfer_backend, "--num-speculative-tokens", str(s.num_speculative_tokens),
             "--speculative-method", s.speculative_method, *metrics, *extra],
        )  # fmt: skip

    def _check_children(self, deadline: float) -> None:
        if self.should_stop():
            raise KeyboardInterrupt
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with status {p.returncode} during start-up")
        if time.monotonic() > deadline:
            raise TimeoutError("the pools did not come up in time")

    def _wait_registered(self, deadline: float) -> None:
        import grpc

        from proto import pb, rpc
        from proto.serving import channel

        want = set(self.node_ids())
        shown = -1
        with channel(self.address) as ch:
            stub = rpc.RegistryStub(ch)
            while True:
                self._check_children(deadline)
                try:
                    nodes = stub.ListNodes(pb.ListNodesRequest(), timeout=2).nodes
                except grpc.RpcError:
                    nodes = []
                up = sorted(n.node.node_id for n in nodes if n.alive and n.node.node_id in want)
                if len(up) != shown:
                    shown = len(up)
                    print(f"  nodes registered: {len(up)}/{len(want)} {' '.join(up)}", file=self.out, flush=True)
                if len(up) == len(want):
                    return
                time.sleep(0.1)

    def poll_exited(self) -> list[tuple[str, int]]:
        """Children that exited since the last call (each reported once)."""
        out = []
        for name, p in self.procs.items():
            if p.poll() is not None and name not in self._reported:
                self._reported.add(name)
                out.append((name, p.returncode))
        return out

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM every component; SIGKILL what has not exited after its drain + 15 s."""
        if timeout is None:
            timeout = self.spec.drain_timeout_s + 15.0
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs.values():  # the group: workers a node left behind, or a stuck node
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if p.poll() is None:
                p.wait(timeout=5)
        self._tmp.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

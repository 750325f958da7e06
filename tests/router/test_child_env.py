"""router/child_env.py: a child started with `launch_env` applies it to itself after exec (CPUs,
nice value, death with its parent) and hands none of it on; read back from the kernel."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from router.child_env import CPUS_ENV, NICE_ENV, PARENT_ENV, launch_env

ROOT = Path(__file__).resolve().parents[2]
APPLY = "from router.child_env import apply_launch_env; apply_launch_env(); "


def _python(code: str, env: dict[str, str]) -> subprocess.Popen:
    inherited = {k: v for k, v in os.environ.items() if k not in (PARENT_ENV, CPUS_ENV, NICE_ENV)}
    full = {**inherited, "PYTHONPATH": str(ROOT), **env}
    return subprocess.Popen([sys.executable, "-c", code], env=full, stdout=subprocess.PIPE, text=True)


def test_child_takes_its_cpus_and_nice_and_passes_nothing_on():
    cpu = max(os.sched_getaffinity(0))
    code = APPLY + (
        "import os; print(sorted(os.sched_getaffinity(0)), os.getpriority(os.PRIO_PROCESS, 0), "
        f"[k for k in ({PARENT_ENV!r}, {CPUS_ENV!r}, {NICE_ENV!r}) if k in os.environ])"
    )
    p = _python(code, launch_env((cpu,), 3))
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0
    start = os.getpriority(os.PRIO_PROCESS, 0)
    assert out.split() == [f"[{cpu}]", str(min(19, start + 3)), "[]"]


def _orphan(asked: bool) -> int:
    """The pid of a child whose parent started it (with launch_env if `asked`) and exited."""
    child = APPLY + f"import time; time.sleep({120 if asked else 5})"
    env = "{**os.environ, **launch_env()}" if asked else "os.environ"
    parent = (
        "import subprocess, sys, os, time; from router.child_env import launch_env; "
        f"p = subprocess.Popen([sys.executable, '-c', {child!r}], env={env}); "
        "print(p.pid, flush=True); time.sleep(1.5)"
    )
    p = _python(parent, {})
    assert p.stdout is not None
    pid = int(p.stdout.readline())
    p.wait(60)
    return pid


def test_child_dies_with_the_process_that_started_it():
    pid = _orphan(asked=True)
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "the child outlived its parent"


def test_no_parent_asked_no_death_signal():
    # without launch_env the child outlives its parent: the test above is not passing by accident
    pid = _orphan(asked=False)
    time.sleep(0.5)
    try:
        assert _alive(pid), "the child died with its parent although nothing asked it to"
    finally:
        if _alive(pid):
            os.kill(pid, 9)


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


SPAWN_BESIDE_GRPC = """
import threading, time, grpc
from concurrent import futures
from router.launch import Cluster, PoolSpec

server = grpc.server(futures.ThreadPoolExecutor(2))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
channel = grpc.insecure_channel(f"127.0.0.1:{port}")
busy = True

def calls():  # gRPC threads in calls whenever a child is started
    while busy:
        try:
            channel.unary_unary("/none/Method")(b"", timeout=0.05)
        except grpc.RpcError:
            pass

threading.Thread(target=calls, daemon=True).start()
time.sleep(0.3)
cluster = Cluster(PoolSpec(model="unused", port=0))
for i in range(5):
    cluster._spawn(f"probe-{i}", ["--help"])
codes = [p.wait(60) for p in cluster.procs.values()]
busy = False
print("exit codes", codes)
"""


def test_up_starts_children_without_forking_grpc_state():
    """`up` starts its children the way that runs none of gRPC's fork handlers (vfork, no
    preexec_fn): started from a process whose gRPC threads are busy, every child runs, and gRPC
    never says it skipped its fork handlers (what it logs when a plain fork meets them)."""
    p = subprocess.run(
        [sys.executable, "-c", SPAWN_BESIDE_GRPC],
        env={**os.environ, "PYTHONPATH": str(ROOT), "GRPC_VERBOSITY": "INFO"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "exit codes [0, 0, 0, 0, 0]" in p.stdout
    assert "fork() handlers" not in p.stderr, p.stderr[-2000:]

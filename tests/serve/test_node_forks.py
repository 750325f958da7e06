"""router/node_forks.py, the launcher `up` forks its nodes from: a node's exit status comes back
as Popen's would (2 for a refused start, minus the signal for a killed node); a forked node
carries its name in comm and command line, leads its own process group and session, runs with
the environment it was given (not the launcher's), and dies with the launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from router.child_env import launch_env
from router.node_forks import GONE, Launcher
from tests.helpers.serve_harness import CLUSTER_TOKEN, ROOT, alive, wait_for


def _node_argv(name: str, model: str) -> list[str]:
    return ["--log-level", "INFO", "decode", "--model", model, "--port", "0", "--node-id", name]


def test_statuses_identity_environment_and_death_with_the_launcher(ckpt, tmp_path, capfd):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PDSERVE_CLUSTER_TOKEN": CLUSTER_TOKEN}
    la = Launcher(env | launch_env(), ["decode"])
    try:
        bad = la.spawn("decode-9", _node_argv("decode-9", str(tmp_path / "nowhere")), env)
        assert bad.wait(60) == 2  # `pdserve decode: error: ...`, as an exec'd node exits

        # one OpenMP thread asked for, where the launcher loaded torch without the variable
        node = la.spawn("decode-0", _node_argv("decode-0", ckpt), env | {"OMP_NUM_THREADS": "1"})
        assert node.poll() is None
        wait_for(lambda: open(f"/proc/{node.pid}/comm").read().strip() == "decode-0", 10, "its name")
        wait_for(lambda: b"--node-id\0decode-0\0" in open(f"/proc/{node.pid}/cmdline", "rb").read(), 10, "its title")
        assert os.getpgid(node.pid) == os.getsid(node.pid) == node.pid
        seen: list[str] = []
        wait_for(lambda: seen.extend(capfd.readouterr()) or "listening on" in "".join(seen), 60, "decode-0 up")
        assert "decode node decode-0: 1 torch threads on CPUs" in "".join(seen)
        node.send_signal(signal.SIGKILL)
        assert node.wait(30) == -signal.SIGKILL

        last = la.spawn("decode-1", _node_argv("decode-1", ckpt), env)
        la.proc.kill()  # the launcher dies (as it does when `up` dies): its nodes get SIGTERM and drain
        la.proc.wait(10)
        wait_for(lambda: not alive(last.pid), 60, "decode-1 to exit with its launcher")
        assert last.wait(10) == GONE
    finally:
        la.close()


_DIES_FIRST = """
import os, sys, time
import router.node_forks as nf
from router.child_env import apply_launch_env

def run(name, argv, env):  # the node's first steps: what it does once its parent is known
    os.environ.update(env)
    apply_launch_env()
    open(sys.argv[1], "w").write("alive")
    return 0

nf._run_node = run
setsid = os.setsid
os.setsid = lambda: (setsid(), time.sleep(1.0))  # the child is slow to start: the launcher is gone by then
print(nf._fork({"name": "decode-0", "argv": [], "env": dict(os.environ)}, []), flush=True)
os._exit(0)
"""


def test_a_node_forked_just_before_its_launcher_dies_dies_too(tmp_path):
    """The launcher dies between the fork and the node's first line (`up` SIGKILLed then): the
    node must not take its new parent (init) for the launcher and live on orphaned; it reads the
    launcher's pid from before the fork, sees it gone and ends itself."""
    out = tmp_path / "alive"
    r = subprocess.run([sys.executable, "-c", _DIES_FIRST, str(out)], cwd=ROOT, capture_output=True, text=True)
    pid = int(r.stdout.split()[0])
    wait_for(lambda: not alive(pid), 20, "the node to end")
    time.sleep(0.2)
    assert not out.exists(), "the node outlived its launcher"

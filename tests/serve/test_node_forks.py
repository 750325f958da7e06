"""router/node_forks.py, the launcher `up` forks its nodes from: a node's exit status comes back
as Popen's would (2 for a refused start, minus the signal for a killed node); a forked node
carries its name in comm and command line, leads its own process group and session, runs with
the environment it was given (not the launcher's), and dies with the launcher."""

from __future__ import annotations

import os
import signal

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

"""How `pdserve up` starts its nodes by default: one launcher process imports the node servers
(torch with them: about 3 of a node's 4.5 s of start-up CPU on a 2-core host) and forks every
node from there, where each node used to import them again (docs/benchmarks.md, "Start-up and
the test suite"). A forked node is what an exec'd one was: its own session and process group,
the environment `up` gave it (applied before it starts a thread), its CPUs, nice value and
OpenMP threads, dying with `up` (through the launcher, which dies with `up`); `ps` and `top` show
it as `pdserve KIND --node-id NAME`. `up --node-start spawn` starts each node as its own
`python -m router.cli` process instead.

The launcher (`python -m router.node_forks`) speaks JSON lines over two pipes: `up` sends
{"name", "argv", "env"}; the launcher answers {"name", "pid"} after each fork and {"pid",
"status"} when a node exits (Popen's returncode: minus the signal that ended it). `Launcher` is
`up`'s side; `ForkedNode` stands where a `subprocess.Popen` stood."""

from __future__ import annotations

import argparse
import atexit
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

from router.child_env import PARENT_ENV, apply_launch_env

_PR_SET_NAME = 15
GONE = -255  # the status of a node whose launcher died before it could report the node's


class Launcher:
    """`up`'s end: starts the launcher process, asks it for nodes, learns their exits."""

    def __init__(self, env: dict[str, str], kinds: list[str]) -> None:
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        cmd = [sys.executable, "-m", "router.node_forks", "--fds", f"{req_r},{rep_w}", "--preload", ",".join(kinds)]
        self.proc = subprocess.Popen(cmd, env=env, pass_fds=(req_r, rep_w), start_new_session=True)
        os.close(req_r)
        os.close(rep_w)
        self._req = os.fdopen(req_w, "w", buffering=1)
        self._cond = threading.Condition()
        self._pids: dict[str, int] = {}
        self._status: dict[int, int] = {}
        self._closed = False  # the launcher's reports ended (it exited)
        threading.Thread(target=self._read, args=(os.fdopen(rep_r),), daemon=True, name="node-forks").start()

    def _read(self, rep) -> None:
        for line in rep:
            msg = json.loads(line)
            with self._cond:
                if "status" in msg:
                    self._status[msg["pid"]] = msg["status"]
                else:
                    self._pids[msg["name"]] = msg["pid"]
                self._cond.notify_all()
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def spawn(self, name: str, argv: list[str], env: dict[str, str], timeout: float = 300.0) -> ForkedNode:
        """Fork node `name` running `pdserve ARGV` in `env`; waits for its pid (the launcher
        imports the node servers first)."""
        self._req.write(json.dumps({"name": name, "argv": argv, "env": env}) + "\n")
        self._req.flush()
        with self._cond:
            if not self._cond.wait_for(lambda: name in self._pids or self._closed, timeout):
                raise TimeoutError(f"the node launcher did not start {name} within {timeout:g} s")
            if name not in self._pids:
                raise RuntimeError(f"the node launcher exited with status {self.proc.wait()} before it started {name}")
            return ForkedNode(self, self._pids[name])

    def status(self, pid: int, timeout: float | None) -> int | None:
        """The node's exit status once it has exited, waiting up to timeout (None: no wait)."""
        with self._cond:
            if timeout:
                self._cond.wait_for(lambda: pid in self._status or self._closed, timeout)
            if pid in self._status:
                return self._status[pid]
            if self._closed and not _exists(pid):  # the launcher is gone, and so is the node
                return GONE
            return None

    def close(self, timeout: float = 10.0) -> None:
        """No more nodes: the launcher exits (its nodes, stopped before, have been reaped)."""
        try:
            self._req.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


class ForkedNode:
    """A node the launcher forked, with the part of `subprocess.Popen` that `up` uses."""

    def __init__(self, launcher: Launcher, pid: int) -> None:
        self._launcher = launcher
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._launcher.status(self.pid, None)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while (rc := self.poll()) is None:
            left = 1.0 if end is None else end - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(f"node {self.pid}", timeout or 0.0)
            self.returncode = self._launcher.status(self.pid, min(left, 1.0))
        return rc

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _stat(pid: int | str) -> list[str]:
    """/proc/PID/stat's fields from the third (state) on: field n is at n - 3."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _exists(pid: int) -> bool:
    """Whether the process runs (an exited one that nobody reaped yet does not)."""
    try:
        return _stat(pid)[0] not in ("Z", "X")
    except OSError:
        return False


# ---- the launcher process ----------------------------------------------------------------------
def _show_as(kind: str, name: str) -> None:
    """The node's name in `ps` and `top`: comm, and the command line written over the launcher's
    (as long as that one was; a longer title is cut)."""
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        libc.prctl(_PR_SET_NAME, name.encode()[:15])
        fields = _stat("self")
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48 and 49)
        title = b"\0".join([b"pdserve", kind.encode(), b"--node-id", name.encode()])[: end - start - 1]
        if 0 < start < end:  # the process's own argv strings, on its stack: written in place
            ctypes.memmove(start, title.ljust(end - start, b"\0"), end - start)
    except (OSError, AttributeError, ValueError, IndexError):
        pass  # the name stays the launcher's: the node runs the same


def _run_node(name: str, argv: list[str], env: dict[str, str]) -> int:
    """In the forked child: become node `name`, as `python -m router.cli ARGV` started in `env`."""
    os.environ.clear()
    os.environ.update(env)
    _show_as(name.rsplit("-", 1)[0], name)

    apply_launch_env()  # dies with the launcher, its CPUs and nice value
    import torch

    # OpenMP read the launcher's environment when torch loaded: the node's thread count now
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0) or len(os.sched_getaffinity(0)))
    sys.argv = ["pdserve", *argv]
    from router.cli import main

    return main(argv)


def _fork(req: dict, own: list[int]) -> int:
    launcher = os.getpid()  # read here: in the child, getppid() is 1 once this process has died
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in own:
            os.close(fd)
        code = _run_node(req["name"], req["argv"], {**req["env"], PARENT_ENV: str(launcher)})
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # what an exec'd node runs as it exits (executors closed, logs flushed)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def _reap(rep) -> None:
    while True:
        try:
            pid, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        rep.write(json.dumps({"pid": pid, "status": os.waitstatus_to_exitcode(st)}) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve-node-forks")
    ap.add_argument("--fds", required=True, help="REQUEST_FD,REPORT_FD")
    ap.add_argument("--preload", default="decode,prefill", help="node kinds whose servers to import")
    args = ap.parse_args(argv)
    req_fd, rep_fd = map(int, args.fds.split(","))

    apply_launch_env()  # dies with `up`
    import gc
    import importlib

    for kind in filter(None, args.preload.split(",")):
        importlib.import_module(f"{kind}_node.server")
    gc.collect()
    gc.freeze()  # what was imported stays out of every node's collector (and unwritten: shared pages)
    rep = os.fdopen(rep_fd, "w", buffering=1)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    own = [req_fd, rep_fd, wake_r, wake_w]
    buf = b""
    while True:
        ready, _, _ = select.select([req_fd, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 512)
            _reap(rep)
        if req_fd in ready:
            data = os.read(req_fd, 1 << 16)
            if not data:  # `up` is done with us
                return 0
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                rep.write(json.dumps({"name": req["name"], "pid": _fork(req, own)}) + "\n")
        _reap(rep)


if __name__ == "__main__":
    sys.exit(main())

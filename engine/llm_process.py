"""The offline `LLM`'s engine in a process of its own, as the nodes run theirs: a script that
imported torch before the engine (OpenMP's threads then spin on the cores the engine's C ops
need) gets the engine's own speed. The parent keeps the `LLM` object; each call (generate,
compute_logits, capacity) travels pickled over a socket pair to `python -m engine.llm_process`,
which runs an in-process `LLM` with OMP_WAIT_POLICY=PASSIVE (threads spin GOMP_SPINCOUNT turns,
then sleep) and the parent's import path. A ValueError raised there (bad input) is raised again
here with its message."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any

STARTUP_TIMEOUT_S = 600.0
SPIN_COUNT = "300000"  # libgomp's own default where threads do not outnumber cores


class EngineProcess:
    """The parent's handle: `call(name, *args, **kwargs)` runs LLM.name in the child."""

    def __init__(self, llm_kwargs: dict[str, Any]):
        ours, theirs = socket.socketpair()
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        # OpenMP threads spin a little after each parallel op before they sleep: the child runs
        # nothing but the engine, and a wake-up per small op cost 12% (docs/benchmarks.md)
        env.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
        self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            [sys.executable, "-m", "engine.llm_process", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            env=env,
        )
        theirs.close()
        self.conn: Connection | None = Connection(ours.detach())
        self.call("__init__", llm_kwargs, timeout=STARTUP_TIMEOUT_S)

    def call(self, name: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        if self.conn is None:
            raise RuntimeError("the LLM is closed")
        self.conn.send((name, args, kwargs))
        if timeout is not None and not self.conn.poll(timeout):
            self.close()
            raise RuntimeError(f"the engine process did not answer {name} within {timeout:.0f} s")
        try:
            kind, payload = self.conn.recv()
        except EOFError:
            self.close()
            raise RuntimeError(f"the engine process died during {name}; see its log above") from None
        if kind == "value_error":
            raise ValueError(payload)
        if kind == "error":
            raise RuntimeError(f"the engine process failed during {name}:\n{payload}")
        return payload

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.conn.close()
            self.conn = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


def main(fd: int) -> None:
    import traceback

    import engine  # noqa: F401  (before torch: the engine's OpenMP policy)
    from engine import heap
    from engine.llm import LLM
    from engine.step_channel import messages

    conn = Connection(fd)
    llm: LLM | None = None
    for name, args, kwargs in messages(conn):
        try:
            if name == "__init__":
                llm = LLM(**args[0], engine_process=False)
                heap.settle()  # a process of the engine's own: its start-up heap out of the collector's walk
                conn.send(("ok", None))
                continue
            assert llm is not None
            conn.send(("ok", getattr(llm, name)(*args, **kwargs)))
        except ValueError as e:
            conn.send(("value_error", str(e)))
        except BaseException:  # noqa: BLE001 (reported to the parent, which raises it)
            conn.send(("error", traceback.format_exc()))
    if llm is not None:
        llm.close()


if __name__ == "__main__":
    main(int(sys.argv[1]))

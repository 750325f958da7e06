"""The offline `LLM`'s engine in a process of its own, as the nodes run theirs: a script that
imported torch before the engine (OpenMP's threads then spin on the cores the engine's C ops
need) gets the engine's own speed. The parent keeps the `LLM` object; each call (generate,
compute_logits, capacity) travels pickled over a socket pair to `python -m engine.llm_process`,
which runs an in-process `LLM` with OMP_WAIT_POLICY=PASSIVE (threads spin GOMP_SPINCOUNT turns,
then sleep) and the parent's import path. A ValueError raised there (bad input) is raised again
here with its message.

Each call carries a sequence number and its reply the same, so a reply belongs to its call: a
call given up while it waited (KeyboardInterrupt, an exception from a signal handler) leaves its
reply to come, and the next call drops it. The parent sends only while no call is pending, so the
child, which looks for a waiting message between engine steps, takes one as the parent giving up
its call: it aborts the call's requests, answers it as interrupted and goes on to the message. A
message is sent and read whole with the parent's signal handlers held off (`_signals_held`): a
handler raising in the middle would leave half a message in the socket."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any

STARTUP_TIMEOUT_S = 600.0
SPIN_COUNT = "300000"  # libgomp's own default where threads do not outnumber cores
CANCEL = "__cancel__"  # the parent gave its call up: no reply


class Interrupted(Exception):
    """Raised in the child's LLM between engine steps when the parent gave the call up."""


@contextmanager
def _signals_held() -> Iterator[None]:
    """Python's signal handlers held off (in the main thread, the only one they run in): a signal
    that arrives is recorded and raised again once the block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    saved = {}
    for sig in (signal.SIGINT, signal.SIGALRM, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        handler = signal.getsignal(sig)
        if callable(handler):
            saved[sig] = handler
            signal.signal(sig, lambda s, _frame: got.append(s))
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        for sig in got:
            signal.raise_signal(sig)


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
        self.seq = 0  # the last call's
        self.call("__init__", llm_kwargs, timeout=STARTUP_TIMEOUT_S)

    def call(self, name: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        if self.conn is None:
            raise RuntimeError("the LLM is closed")
        self.seq += 1
        seq = self.seq
        with _signals_held():
            self.conn.send((seq, name, args, kwargs))
        try:
            kind, payload = self._reply(seq, name, timeout)
        except BaseException:  # given up while waiting: the child stops the call's work
            if self.conn is not None:
                try:
                    with _signals_held():
                        self.conn.send((seq, CANCEL, (), {}))
                except OSError:
                    pass
            raise
        if kind == "interrupted":
            raise RuntimeError(f"the engine process gave {name} up")
        if kind == "value_error":
            raise ValueError(payload)
        if kind == "error":
            raise RuntimeError(f"the engine process failed during {name}:\n{payload}")
        return payload

    def _reply(self, seq: int, name: str, timeout: float | None) -> tuple[str, Any]:
        """The reply to call `seq`; replies to calls given up before it are dropped."""
        assert self.conn is not None
        while True:
            if not self.conn.poll(timeout):  # waits here, where an interrupt leaves no half-read message
                self.close()
                raise RuntimeError(f"the engine process did not answer {name} within {timeout:.0f} s")
            try:
                with _signals_held():
                    got, kind, payload = self.conn.recv()
            except EOFError:
                self.close()
                raise RuntimeError(f"the engine process died during {name}; see its log above") from None
            if got == seq:
                return kind, payload

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

    def reply(seq: int, kind: str, payload: Any) -> None:
        try:
            conn.send((seq, kind, payload))
        except OSError:  # the parent closed its end while this call ran: nobody waits for it
            pass

    llm: LLM | None = None
    for seq, name, args, kwargs in messages(conn):
        if name == CANCEL:  # its call was answered or interrupted already
            continue
        try:
            if name == "__init__":
                llm = LLM(**args[0], engine_process=False)
                llm.interrupted = lambda: conn.poll(0)
                heap.settle()  # a process of the engine's own: its start-up heap out of the collector's walk
                reply(seq, "ok", None)
                continue
            assert llm is not None
            reply(seq, "ok", getattr(llm, name)(*args, **kwargs))
        except Interrupted:
            reply(seq, "interrupted", None)
        except ValueError as e:
            reply(seq, "value_error", str(e))
        except BaseException:  # noqa: BLE001 (reported to the parent, which raises it)
            reply(seq, "error", traceback.format_exc())
    if llm is not None:
        llm.close()


if __name__ == "__main__":
    main(int(sys.argv[1]))

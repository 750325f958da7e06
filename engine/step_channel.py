"""Step inputs from a node's engine process to its tensor-parallel ranks: each step is pickled
once into a shared-memory buffer that every rank maps, and a rank's pipe carries only the length
(a step larger than the buffer travels pickled in the pipes instead). A row's page list and ids
travel as what they gained since the last step (engine/step_lists.py). The engine writes a step only
after every rank answered the previous one, so one buffer is never read and written at once."""

from __future__ import annotations

import mmap
import os
import pickle
import tempfile
from collections.abc import Iterator
from typing import Any

from engine.step import StepInput
from engine.step_lists import ListReceiver, ListSender

BUFFER_BYTES = 8 << 20


def shm_dir() -> str | None:
    """/dev/shm where it exists (memory, not disk), else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class StepWriter:
    """The engine's side: owns the buffer's file, removed once every rank mapped it (`unlink`:
    nothing is left behind if the engine dies later) or at close."""

    def __init__(self, size: int = BUFFER_BYTES):
        self._lists = ListSender()
        fd, self.path = tempfile.mkstemp(prefix="pdserve-steps-", dir=shm_dir())
        try:
            os.ftruncate(fd, size)
            self._buf: mmap.mmap | None = mmap.mmap(fd, size)
        finally:
            os.close(fd)

    def write(self, step: StepInput) -> int | bytes:
        """Pickle `step` into the buffer, its rows' long lists as what they gained since the last
        step (engine/step_lists.py): its length, or the pickled step itself where it does not fit
        (it then goes down the pipes; `StepReader.read` takes either)."""
        assert self._buf is not None, "the step channel is closed"
        blob = None
        try:
            self._lists.swap_in(step)
            blob = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        finally:
            self._lists.swap_out(sent=blob is not None)
        if len(blob) > len(self._buf):
            return blob
        self._buf[: len(blob)] = blob
        return len(blob)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self._buf is not None:
            self._buf.close()
            self._buf = None
        self.unlink()


class StepReader:
    """A rank's side: maps the engine's buffer read-only."""

    def __init__(self, path: str):
        self._lists = ListReceiver()
        with open(path, "rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def read(self, msg: int | bytes) -> StepInput:
        """The step `StepWriter.write` wrote: its length in the buffer, or the step pickled."""
        step = pickle.loads(self._buf[:msg] if isinstance(msg, int) else msg)
        assert isinstance(step, StepInput)
        return self._lists.restore(step)

    def close(self) -> None:
        self._buf.close()


def messages(conn: Any) -> Iterator[Any]:
    """What a serving process receives on its pipe, until the pipe closes or a None arrives (how
    a rank and the offline LLM's engine process are told to stop)."""
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        yield msg

"""Step inputs from a node's engine process to its tensor-parallel ranks: each step is pickled
once into a shared-memory buffer that every rank maps, and a rank's pipe carries only the length
(a step larger than the buffer travels pickled in the pipes instead). A row's page list and ids
travel as what they gained since the last step (engine/step_lists.py). A steady step (the last
step's rows, each a token on: engine/step_input.py advance) travels as what moved, each row's
token, position and output count, and the rank moves the rows it kept. The engine writes a step
only after every rank answered the previous one, so one buffer is never read and written at once."""

from __future__ import annotations

import dataclasses
import mmap
import os
import pickle
import tempfile
from collections.abc import Iterator
from typing import Any

from engine.step import RowInput, StepInput
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
        self._rows: list | None = None  # the rows list of the last step sent with rows, and its length
        self._count = 0
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
        rows = step.rows
        try:
            self._lists.swap_in(step)
            if step.steady and rows and rows is self._rows and len(rows) == self._count:  # the rank's rows, moved on
                moved = (
                    dataclasses.replace(step, rows=[]),
                    [r.token_ids[0] for r in rows],
                    [r.start_pos for r in rows],
                    [r.num_output for r in rows],
                    [(r.block_ids, r.history, r.params) for r in rows],
                )
                blob = pickle.dumps(moved, protocol=pickle.HIGHEST_PROTOCOL)
            else:
                blob = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        finally:
            self._lists.swap_out(sent=blob is not None)
        if rows:
            self._rows, self._count = rows, len(rows)
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
        self._rows: list[RowInput] = []  # the rows of the last step read with rows: a steady step moves them
        with open(path, "rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def read(self, msg: int | bytes) -> StepInput:
        """The step `StepWriter.write` wrote: its length in the buffer, or the step pickled."""
        step = pickle.loads(self._buf[:msg] if isinstance(msg, int) else msg)
        if isinstance(step, tuple):  # a steady step: what moved in the rows kept
            step, tokens, starts, outputs, lists = step
            step.rows = self._rows
            for r, t, s, n, (pages, history, params) in zip(self._rows, tokens, starts, outputs, lists, strict=True):
                r.token_ids, r.start_pos, r.num_output = [t], s, n
                r.block_ids, r.history, r.params = pages, history, params
        assert isinstance(step, StepInput)
        if step.rows:
            self._rows = step.rows
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

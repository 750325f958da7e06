"""The CPU all-reduce of a node's tensor-parallel ranks over shared memory. Each rank copies its
tensor into its own slot of one mapped buffer, raises its sequence number, waits until every
rank has raised it, and sums the slots in rank order, so every rank gets the same bits. Two sets
of slots alternate: a rank that raised number s knows every other rank has finished reading the
slots of s - 1's set before writing s + 1 into it, so one wait per all-reduce is enough. Two
ranks each add the other's slot to their own tensor (addition commutes exactly). Tensors
larger than a slot go through in slot-sized pieces. gloo over loopback TCP, which this replaces
on the CPU, cost a 2-core host 313 us at the median and 4 ms at p90 per all-reduce, with the
waiting rank asleep in a socket (docs/benchmarks.md, "Tensor-parallel all-reduce on the CPU").
x86 only: its stores are seen in program order, so a slot written before its sequence number is
read whole after it (a locked instruction orders the copy's stores before the number's)."""

from __future__ import annotations

import mmap
import os
import platform
import tempfile
import threading
import time

import numpy as np
import torch

from engine.step_channel import shm_dir

LINE = 64  # each rank's sequence number on a cache line of its own
# bytes of one rank's slot: a larger tensor goes in pieces; under glibc's threshold for the
# non-temporal stores a large copy may use (those would need a fence of their own)
SLOT_BYTES = 1 << 20
SPINS = 256  # checks of the others' numbers before yielding between them (some tens of microseconds)
YIELD_S = 0.02  # then yielding the core between checks for this long, then sleeping


def supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def buffer_bytes(world: int) -> int:
    return world * LINE + 2 * world * SLOT_BYTES


def create(world: int) -> str:
    """The buffer's file (in /dev/shm where it exists), zeroed: the executor's, removed once every
    rank mapped it."""
    fd, path = tempfile.mkstemp(prefix="pdserve-allreduce-", dir=shm_dir())
    try:
        os.ftruncate(fd, buffer_bytes(world))
    finally:
        os.close(fd)
    return path


class ShmAllReduce:
    """Rank `rank` of `world`'s side, called as `all_reduce(x)`: x (a CPU tensor) summed over the
    ranks in place and returned. A rank that waits longer than `timeout_s` for the others raises
    RuntimeError (a peer died or hangs)."""

    def __init__(self, path: str, rank: int, world: int, timeout_s: float = 300.0):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, buffer_bytes(world))
        finally:
            os.close(fd)
        self._seqs = np.ndarray((world, LINE // 8), dtype=np.int64, buffer=self._mm)[:, 0]
        data = torch.frombuffer(self._mm, dtype=torch.uint8, offset=world * LINE, count=2 * world * SLOT_BYTES)
        self._slots = data.view(2, world, SLOT_BYTES)
        self._others = [r for r in range(world) if r != rank]
        self._typed: dict[torch.dtype, list[list[torch.Tensor]]] = {}
        self._seq = 0
        self._fence = threading.Lock()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        assert x.device.type == "cpu", "the shared-memory all-reduce takes CPU tensors"
        if not x.is_contiguous():  # summed in a contiguous copy, written back
            return x.copy_(self(x.contiguous()))
        rows = self._typed.get(x.dtype)
        if rows is None:  # each parity's and rank's slot seen as this dtype
            typed = self._slots.view(x.dtype)
            rows = self._typed[x.dtype] = [[typed[p, r] for r in range(self.world)] for p in (0, 1)]
        n, cap, flat = x.numel(), rows[0][0].numel(), x.view(-1)
        if n <= cap:
            self._reduce(flat, n, rows)
        else:
            for lo in range(0, n, cap):
                self._reduce(flat[lo : lo + cap], min(cap, n - lo), rows)
        return x

    def _reduce(self, part: torch.Tensor, n: int, rows: list[list[torch.Tensor]]) -> None:
        self._seq += 1
        s = self._seq
        mine = rows[s & 1]
        mine[self.rank][:n].copy_(part)
        with self._fence:  # a locked instruction: the slot's stores are visible before the number's
            pass
        self._seqs[self.rank] = s
        self._wait(s)
        if self.world == 2:  # x + other on each rank: the same bits either way round
            part.add_(mine[1 - self.rank][:n])
            return
        part.copy_(mine[0][:n])
        for r in range(1, self.world):
            part.add_(mine[r][:n])

    def _wait(self, s: int) -> None:
        """Until every rank has raised its number to s: spinning at first (the ranks of a step
        arrive together), then yielding the core between checks (a rank waiting for one the OS
        has descheduled, with more processes than cores, lets that one run; a sleep would cost a
        wake-up, which on the virtual machines measured takes hundreds of microseconds), and
        past YIELD_S sleeping between checks."""
        seqs, spins, since = self._seqs, 0, 0.0
        while True:
            if all(seqs[r] >= s for r in self._others):
                return
            spins += 1
            if spins < SPINS:
                continue
            if spins == SPINS:
                since = time.monotonic()
                continue
            waited = time.monotonic() - since
            if waited < YIELD_S:
                os.sched_yield()
            elif waited > self.timeout_s:
                raise RuntimeError(
                    f"tensor-parallel rank {self.rank} waited {self.timeout_s:.0f} s for the others' all-reduce "
                    "(a rank died or hangs)"
                )
            else:
                time.sleep(1e-4)

    def close(self) -> None:
        self._slots = self._seqs = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # a tensor still views it: the mapping goes with the process
            pass

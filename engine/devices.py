"""Which device each tensor-parallel rank of a node computes on, and the fence a transfer waits on
before it reads what a step wrote.

`rank_devices` is the one place the mapping is decided: `--device cpu` puts every rank on the
CPU; `--device cuda` gives rank r the node's r-th visible CUDA device (CUDA_VISIBLE_DEVICES
decides which those are); `--device cuda:2,3` names the local devices of ranks 0, 1, ... in order.
The node checks the mapping before it starts a rank, so a node with fewer devices than ranks
stops with one line saying so. A rank calls `bind` before it allocates anything: it makes its
device current, so NCCL, the caching allocator and NIXL's VRAM registrations all land on it.

`StepFence`: a step's kernels may still run after the step returns (only rank 0 reads its
results back); the worker records the fence after each step and a push of a request's pages
waits on it before a transport reads them; `StepFence.mark` records a `DeviceMark` inside a step
(after one decoder layer's kernels) that a layer's post polls without blocking. On the CPU these
are no-ops."""

from __future__ import annotations

import os
from typing import Protocol

import torch


def rank_devices(device: str, tp: int, visible: int) -> list[torch.device]:
    """device: the node's --device ("cpu", "cuda", "cuda:N" or "cuda:N,M,..."); tp: the node's
    tensor-parallel ranks; visible: the CUDA devices this process sees -> rank r's device.
    Raises ValueError, one line, when the devices cannot hold the ranks."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1 (got {tp})")
    kind, _, listed = device.partition(":")
    if kind == "cpu" and not listed:
        return [torch.device("cpu")] * tp
    if kind != "cuda":
        raise ValueError(f"--device must be cpu, cuda or cuda:N[,M...] (got {device!r})")
    if listed:
        try:
            idx = [int(x) for x in listed.split(",")]
        except ValueError:
            raise ValueError(f"--device {device!r}: the CUDA device indices must be integers") from None
        if len(idx) != tp:
            raise ValueError(f"--device {device!r} names {len(idx)} CUDA device(s) for {tp} tensor-parallel rank(s)")
        if len(set(idx)) != len(idx):
            raise ValueError(f"--device {device!r} names a CUDA device twice: each rank needs its own")
    else:
        idx = list(range(tp))
    if visible < max(idx) + 1 or any(i < 0 for i in idx):
        seen = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={seen})" if seen is not None else ""
        raise ValueError(
            f"{tp} tensor-parallel rank(s) on --device {device} need CUDA device(s) {idx}; "
            f"this node sees {visible}{where}"
        )
    return [torch.device("cuda", i) for i in idx]


def visible_cuda_devices() -> int:
    """How many CUDA devices this process sees (0 without CUDA), without creating a context."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def node_devices(device: str, tp: int) -> list[torch.device]:
    """rank_devices for this node's visible devices (checked by the node before its ranks start)."""
    return rank_devices(device, tp, visible_cuda_devices() if device.startswith("cuda") else 0)


def bind(device: torch.device) -> None:
    """Make `device` this process's current device: before any allocation and before the process
    group starts, so that every later `cuda` tensor, NCCL's communicator and NIXL's registrations
    use it."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


class DeviceMark(Protocol):
    """A point in a device stream (a CUDA event): `query` is True once the kernels queued before
    it have finished. Never blocks."""

    def query(self) -> bool: ...


class StepFence:
    """An event recorded on the device's current stream after each step; `wait` blocks the host
    until the kernels queued before the last `record` have finished (a no-op on the CPU). One
    event, recorded again each step (a new one a step cost an event's creation and destruction):
    a `wait` that comes after a later step's record waits for that step too, which only waits
    longer."""

    def __init__(self, device: torch.device):
        self.device = device
        self._event: torch.cuda.Event | None = None

    def record(self) -> None:
        if self.device.type == "cuda":
            if self._event is None:
                self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(self.device))

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def mark(self) -> DeviceMark | None:
        """An event recorded now on the device's current stream, after the kernels queued so far
        (one decoder layer's, inside a step); None on the CPU, where they have run already."""
        if self.device.type != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

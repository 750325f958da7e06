"""What a rank measures to plan its cache from the device (engine/cache/memory_plan.py): free and
total memory before it loads anything, what the model holds, and the peak of a profile step at the
largest batch it will run. `MemoryProbe` is the one interface (CUDA: `CudaProbe`; tests give
fixed figures); `profile_steps` are the steps (docs/engine.md, "Memory")."""

from __future__ import annotations

import gc
import os
from typing import Protocol

import torch

from engine.cache.allocator import Capacity
from engine.cache.memory_plan import DeviceFacts
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.step import RowInput, StepInput


class MemoryProbe(Protocol):
    def start(self) -> None:
        """Before the rank allocates anything."""

    def loaded(self) -> None:
        """After the model is built."""

    def stepping(self) -> None:
        """After the profile's own pools are made, right before its steps (peak statistics reset)."""

    def facts(self) -> DeviceFacts:
        """After the profile steps, their pools freed."""


def outside_bytes(
    total: int, free_start: int, free_now: int, own_start: int | None, own_now: int | None, reserved: int
) -> int:
    """Memory taken since start-up and not by PyTorch's allocator (NCCL's buffers, loaded CUDA
    modules): this process's growth as the driver counts it where NVML gave both readings, else
    the device's (which also counts what other processes took meanwhile: engines starting side
    by side on one GPU would each see the others' memory as their own)."""
    if own_start is not None and own_now is not None:
        grown = own_now - own_start
    else:
        grown = (total - free_now) - (total - free_start)
    return max(grown - reserved, 0)


def own_device_bytes(device: torch.device) -> int | None:
    """This process's memory on `device` as the driver counts it (NVML, where nvidia-ml-py is
    installed and lists the process), else None."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
    except Exception:  # no driver library, another PID namespace, a field the driver withholds
        return None
    return None


class CudaProbe:
    def __init__(self, device: torch.device):
        self.device = device
        self._free = self._total = self._base = self._weights = self._stepping = 0
        self._own: int | None = None

    def start(self) -> None:
        gc.collect()  # an engine this process closed before: its blocks go back to the device, not
        torch.cuda.empty_cache()  # counted as another process's
        torch.cuda.synchronize(self.device)
        self._free, self._total = torch.cuda.mem_get_info(self.device)
        self._base = torch.cuda.memory_allocated(self.device)
        self._own = own_device_bytes(self.device)

    def loaded(self) -> None:
        torch.cuda.synchronize(self.device)
        self._weights = torch.cuda.memory_allocated(self.device) - self._base

    def stepping(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._stepping = torch.cuda.memory_allocated(self.device)

    def facts(self) -> DeviceFacts:
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - self._stepping
        free, _ = torch.cuda.mem_get_info(self.device)
        own = own_device_bytes(self.device) if self._own is not None else None
        reserved = torch.cuda.memory_reserved(self.device)
        outside = outside_bytes(self._total, self._free, free, self._own, own, reserved)
        return DeviceFacts(self._total, self._free, self._weights, max(peak, 0), outside)


_PARAMS = SamplingParams(temperature=0.7, top_p=0.8, top_k=20)  # top-k and top-p: the sampler's widest path


def profile_steps(cfg: EngineConfig) -> tuple[Capacity, list[StepInput]]:
    """The pages and slots the profile needs, and its steps: max_num_batched_tokens prompt tokens
    over min(max_num_seqs, tokens) rows that all sample; with drafts, then a decode step of those
    rows, each verifying num_speculative_tokens drafts."""
    s, bs, k = cfg.scheduler, cfg.cache.block_size, cfg.speculative.num_tokens
    n = min(s.max_num_seqs, s.max_num_batched_tokens)
    lens = [s.max_num_batched_tokens // n + (i < s.max_num_batched_tokens % n) for i in range(n)]
    lens = [min(x, cfg.max_model_len - k - 1) for x in lens]
    per_row = -(-(max(lens) + k + 1) // bs)
    vocab = cfg.model.vocab_size
    rows, decode = [], []
    for i, x in enumerate(lens):
        blocks = list(range(i * per_row, (i + 1) * per_row))
        ids = [(i * 7919 + j) % vocab for j in range(x)]
        rid = f"profile-{i}"
        rows.append(RowInput(rid, ids, 0, i, blocks, False, True, params=_PARAMS, draft_depths=(k,)))
        if k:
            draft = [(ids[-1] + j + 1) % vocab for j in range(k + 1)]
            depths = (k,) * (k + 1)
            row = RowInput(rid, draft, x, i, blocks, True, True, params=_PARAMS, num_draft=k, draft_depths=depths)
            decode.append(row)
    cap = Capacity(0, 0, 0, n * per_row, bs, 0, n)
    steps = [StepInput(rows)] + ([StepInput(decode)] if decode else [])
    return cap, steps

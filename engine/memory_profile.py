"""What a rank measures to plan its cache from the device (engine/cache/memory_plan.py): free and
total memory before it loads anything, what the model holds, and the peak of a profile step at the
largest batch it will run. `MemoryProbe` is the one interface (CUDA: `CudaProbe`; tests give
fixed figures); `profile_steps` are the steps (docs/engine.md, "Memory")."""

from __future__ import annotations

import gc
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


class CudaProbe:
    def __init__(self, device: torch.device):
        self.device = device
        self._free = self._total = self._base = self._weights = self._stepping = 0

    def start(self) -> None:
        gc.collect()  # an engine this process closed before: its blocks go back to the device, not
        torch.cuda.empty_cache()  # counted as another process's
        torch.cuda.synchronize(self.device)
        self._free, self._total = torch.cuda.mem_get_info(self.device)
        self._base = torch.cuda.memory_allocated(self.device)

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
        # taken since start-up and not by PyTorch's allocator (NCCL's buffers, loaded CUDA modules)
        outside = (self._total - free) - (self._total - self._free) - torch.cuda.memory_reserved(self.device)
        return DeviceFacts(self._total, self._free, self._weights, max(peak, 0), max(outside, 0))


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

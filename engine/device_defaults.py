"""Defaults that depend on the device. The cache budget:  `--kv-cache-memory` on the CPU (default
256MiB; `--gpu-memory-utilization` is ignored there with a warning), a planned share of the
device on CUDA (engine/cache/memory_plan.py), where a given `--kv-cache-memory` wins.
`PDSERVE_GPU_MEMORY_UTILIZATION` sets that share where no flag gives one: engines sharing a GPU
(a test run's parallel workers, several nodes on one device) each take a part of it. And
`--batch-invariant` left unset: on for bfloat16 on the CPU with the C operators (`default_batch_invariant`)."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import EngineArgs, ModelConfig

log = logging.getLogger("pdserve.config")

CPU_KV_CACHE_MEMORY = "256MiB"
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
GPU_MEMORY_UTILIZATION_ENV = "PDSERVE_GPU_MEMORY_UTILIZATION"


def default_gpu_memory_utilization() -> float:
    """The share of a CUDA device the cache is planned from when no flag gives one: the
    environment's PDSERVE_GPU_MEMORY_UTILIZATION, else 0.9."""
    raw = os.environ.get(GPU_MEMORY_UTILIZATION_ENV)
    if not raw:
        return DEFAULT_GPU_MEMORY_UTILIZATION
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{GPU_MEMORY_UTILIZATION_ENV}={raw!r} is not a number: give a share in (0, 1]") from None


def budget_source(
    kv_cache_memory: int | str | None, gpu_memory_utilization: float | None, device: str
) -> tuple[int | str | None, float | None]:
    """(kv_cache_memory, gpu_memory_utilization) for CacheConfig: the fraction is None where the
    budget is the byte count alone; the byte count None where the fraction alone plans it."""
    g = gpu_memory_utilization
    if g is None and str(device).startswith("cuda"):
        g = default_gpu_memory_utilization()
    if g is not None and not 0.0 < g <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1] (got {g})")
    if not str(device).startswith("cuda"):
        if g is not None:
            log.warning(
                "--gpu-memory-utilization %g is ignored on %s: the cache budget there is --kv-cache-memory (%s)",
                g,
                device,
                kv_cache_memory or CPU_KV_CACHE_MEMORY,
            )
        return kv_cache_memory or CPU_KV_CACHE_MEMORY, None
    return kv_cache_memory, g


def default_draft_cost(device: str) -> float:
    """The draft cost (SpeculativeConfig.draft_cost) a device gets unless one is given: on the CPU a
    step's GEMMs grow with its rows (2-4 rows cost 1.6-2.6x one, docs/ARCHITECTURE.md) and each draft
    is one more MTP pass, so a draft costs about half a plain step (bench/mtp.py: 1.04 tokens per
    step ran at 0.55-0.68x); on a GPU a decode step is bound by reading the weights, so a few more
    rows cost little and one MTP layer is a small part of a step."""
    return 0.5 if device == "cpu" else 0.1


def default_local_prefill_step_tokens(device: str) -> int:
    """The prompt tokens a decode node's short prompts (its follow-up turns) take of one step
    altogether, unless given: on the CPU a step's time grows with its tokens, and 128 of them keep
    a burst of follow-ups from stretching a step that every stream there waits for (docs/benchmarks.md,
    multi-turn); on a GPU a few thousand prompt tokens add little to a decode step."""
    return 128 if device == "cpu" else 2048


def default_batch_invariant(model: ModelConfig, args: EngineArgs) -> bool:
    """--batch-invariant left unset: on for a bfloat16 model on the CPU with the C operators, a
    float32 GDN state and no weights kept in FP8 (what the mode runs), off otherwise (docs/engine.md,
    "Batch-invariant mode"): its GEMM beats oneDNN's at a decode step's rows with or without
    AVX512-BF16 (the same bits either way). On CUDA it is on only when asked for: its Triton path
    has not yet run on a GPU. A node without the C operators resolves it off: the
    transfer handshake then names the option."""
    import torch

    from kernels import cpu_ops

    if not args.device.startswith("cpu") or model.dtype != torch.bfloat16 or args.mamba_ssm_cache_dtype == "bfloat16":
        return False
    if model.fp8_block_size is not None and "keep" in (args.fp8_experts, args.fp8_dense):
        return False
    return cpu_ops.available(torch.bfloat16)

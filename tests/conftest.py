"""Shared fixtures: tiny Qwen3.5 checkpoints written by transformers' own classes (random
weights, fixed seed, save_pretrained) and loaded through our loader, as real ones would be."""

from __future__ import annotations

import os
import sys

# Before torch loads: OpenMP threads sleep at the end of a parallel region instead of spinning
# (what engine/__init__.py sets for the servers). The suite runs servers, TP ranks and
# references side by side on 2 cores, where a spinning thread holds a core another process
# needs: two engine test files took 124 s with the default policy and 10 s passive.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# On a GPU, engines of parallel test workers (pytest-xdist, tools/gpu_check.sh) share the device:
# each plans its cache from a twentieth of it unless a test names a share (engine/device_defaults.py).
os.environ.setdefault("PDSERVE_GPU_MEMORY_UTILIZATION", "0.05")

import pytest  # noqa: E402
import torch  # noqa: E402

# transformers is the reference: keep it on its own PyTorch code even where flash-linear-attention
# or causal-conv1d is installed (tools/gpu_check.sh prepare --fla brings fla for the benchmark),
# whose kernels its Qwen3.5 modules would otherwise pick when first imported.
for _pkg in ("fla", "causal_conv1d"):
    sys.modules.setdefault(_pkg, None)
# transformers 5.25 and later kernelize a model from_pretrained loads with kernels fetched from the
# Hugging Face Hub unless told not to: the reference runs its own PyTorch code, offline, and works
# where Hugging Face's `kernels` package is absent (it takes our kernels/ import name: README.md)
os.environ.setdefault("USE_HUB_KERNELS", "0")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def _cuda() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    slow = os.environ.get("PDSERVE_SLOW") == "1"
    for item in items:
        if "gpu" in item.keywords and not _cuda():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "slow" in item.keywords and not slow:
            item.add_marker(pytest.mark.skip(reason="slow tier: run with PDSERVE_SLOW=1"))

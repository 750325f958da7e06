"""Triton kernels: the GPU path of the ops in kernels/*.py, one family per module, each with a
wrapper that takes the PyTorch reference's arguments and checks shapes. The ops dispatch here on
CUDA tensors or with PDSERVE_FORCE_TRITON=1. Importing this package imports no Triton
(docs/kernels.md, "Module notes")."""

from __future__ import annotations

import os

__all__ = ["force_triton"]


def force_triton() -> bool:
    """True when PDSERVE_FORCE_TRITON=1: the ops take the Triton path on any device."""
    return os.environ.get("PDSERVE_FORCE_TRITON", "0") == "1"

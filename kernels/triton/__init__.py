"""Triton kernels: the GPU path of the ops in kernels/*.py.

Each module holds one family of kernels and a Python wrapper per op with the same arguments and
semantics as its PyTorch reference (kernels/gdn.py, conv.py, attention.py, norm.py, fp8.py), plus an
optional preallocated `out`. The wrappers check shapes, dtypes and strides and raise ValueError
quoting the actual shapes; the kernels check nothing.

    gdn_chunk.py        gdn_chunk_prefill_triton    chunked gated delta rule, varlen, slot state
                                                    (every chunk at once, then one state pass)
    gdn_recurrent.py    gdn_recurrent_triton        token loop for decode rows of 1..k+1 tokens
    conv.py             causal_conv1d_triton, causal_conv1d_update_triton
    paged_attention.py  store_kv_triton, paged_attention_triton (a GQA group per program)
    norm.py             gated_rms_norm_triton
    fp8.py              fp8_block_linear_triton      block-scaled FP8 weights, dequantized per tile

The ops in kernels/*.py dispatch here when their first tensor is on CUDA, or on any device when
PDSERVE_FORCE_TRITON=1 (with TRITON_INTERPRET=1 that runs the kernels on CPU tensors; tests call
the wrappers directly). This module imports nothing from Triton, so importing the PyTorch ops
never imports Triton; TRITON_INTERPRET must be set before the first kernel module is imported,
because Triton reads it when a kernel is decorated.
"""

from __future__ import annotations

import os

__all__ = ["force_triton"]


def force_triton() -> bool:
    """True when PDSERVE_FORCE_TRITON=1: the ops take the Triton path on any device."""
    return os.environ.get("PDSERVE_FORCE_TRITON", "0") == "1"

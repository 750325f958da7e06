"""The batch-invariant GEMM's contract and its PyTorch reference: y [M, N] = x [M, K] @ w [N, K]^T,
float32 sums rounded once to x's dtype, each row's bits the same at any M (Triton on CUDA,
kernels/triton/gemm_invariant.py; `Linear` kind "invariant" in engine/model/linear.py). The
reference computes the same sums in another order (torch's matmul blocks them by M), so it
checks values, not bits; the CPU's invariant GEMM is `cpu_ops.gemm_bf16` / `gemm_f32`."""

from __future__ import annotations

import torch

from kernels.triton import force_triton as _force_triton

__all__ = ["gemm_invariant", "gemm_invariant_ref"]


def gemm_invariant_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] in x's dtype, summed in float32 (the reference)."""
    return (x.float() @ w.float().T).to(x.dtype)


def gemm_invariant(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K], w [N, K] -> [M, N] in x's dtype: the Triton kernel on CUDA (or with
    PDSERVE_FORCE_TRITON=1), whose rows do not depend on M; the reference elsewhere."""
    if x.is_cuda or _force_triton():
        from kernels.triton.gemm_invariant import gemm_invariant_triton

        return gemm_invariant_triton(x, w, out)
    y = gemm_invariant_ref(x, w)
    return y if out is None else out.copy_(y)

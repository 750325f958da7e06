"""RMS norms of the Qwen3.5 stack (PyTorch path).

    rms_norm        x [..., D], weight [D]; y = x / rms(x) * (1 + w)   (zero-centred weights;
                    pass zero_centered=False with a precomputed 1 + w to save an op per call)
    gated_rms_norm  x, z [..., D], weight [D]; y = (x / rms(x)) * w * silu(z)
    add_rms_norm    x, h [T, D], scale [D] float32 -> (x + h, rms_norm(x + h) * scale): the
                    residual add and the next norm, one fused C call on the CPU (kernels/cpu_ops.py)
Both normalise in float32 and return x's dtype, rounding where transformers rounds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_ops
from kernels.triton import force_triton as _force_triton

__all__ = ["rms_norm", "gated_rms_norm", "add_rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = True) -> torch.Tensor:
    scale = 1.0 + weight.float() if zero_centered else weight
    return F.rms_norm(x.float(), (x.shape[-1],), scale, eps).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda or _force_triton():
        from kernels.triton.norm import gated_rms_norm_triton

        return gated_rms_norm_triton(x, z, weight, eps)
    y = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight
    return (y * F.silu(z.float())).to(x.dtype)


def add_rms_norm(x: torch.Tensor, h: torch.Tensor | None, scale: torch.Tensor, eps: float):
    """Returns (x + h, the RMS norm of x + h times `scale`) with x + h rounded to x's dtype first
    (h None: (x, its norm)). `scale` is float32, the precomputed 1 + w."""
    if (
        not x.is_cuda
        and x.dim() == 2
        and x.is_contiguous()
        and cpu_ops.available(x.dtype)
        and (h is None or (h.is_contiguous() and h.dtype == x.dtype and h.shape == x.shape))
    ):
        return cpu_ops.add_rms_norm(x, h, scale, eps)
    if h is not None:
        x = x + h
    return x, rms_norm(x, scale, eps, zero_centered=False)

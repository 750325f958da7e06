"""RMS norms of the Qwen3.5 stack (PyTorch path).

    rms_norm        x [..., D], weight [D]; y = x / rms(x) * (1 + w)   (zero-centred weights;
                    pass zero_centered=False with a precomputed 1 + w to save an op per call)
    gated_rms_norm  x, z [..., D], weight [D]; y = (x / rms(x)) * w * silu(z)
Both normalise in float32 and return x's dtype, rounding where transformers rounds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.triton import force_triton as _force_triton

__all__ = ["rms_norm", "gated_rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = True) -> torch.Tensor:
    scale = 1.0 + weight.float() if zero_centered else weight
    return F.rms_norm(x.float(), (x.shape[-1],), scale, eps).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda or _force_triton():
        from kernels.triton.norm import gated_rms_norm_triton

        return gated_rms_norm_triton(x, z, weight, eps)
    y = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight
    return (y * F.silu(z.float())).to(x.dtype)

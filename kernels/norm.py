"""RMS norms of the Qwen3.5 stack (PyTorch path).

    rms_norm        x [..., D], weight [D]; y = x / rms(x) * (1 + w)   (zero-centred weights)
    gated_rms_norm  x, z [..., D], weight [D]; y = (x / rms(x)) * w * silu(z)
Both normalise in float32 and return x's dtype, rounding where transformers rounds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.triton import force_triton as _force_triton

__all__ = ["rms_norm", "gated_rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda or _force_triton():
        from kernels.triton.norm import gated_rms_norm_triton

        return gated_rms_norm_triton(x, z, weight, eps)
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = weight * y
    return (y * F.silu(z.float())).to(x.dtype)

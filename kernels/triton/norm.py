"""Fused gated RMSNorm (the GDN output norm), Triton.

Same contract as kernels.norm.gated_rms_norm: x, z [..., D], weight [D];
y = (x / rms(x)) * w * silu(z), normalised in float32 and rounded where the reference rounds
(to x's dtype after normalising, to the promoted dtype of weight and x after the weight).
One program per row: one read of x, z and w and one write of y instead of the reference's
chain of elementwise kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton._common import TL_DTYPES as _TL
from kernels.triton._common import check_last_contiguous, check_same_device
from kernels.triton._common import round_to as _round

__all__ = ["gated_rms_norm_triton"]


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr,
    z_ptr,
    w_ptr,
    y_ptr,
    s_x,
    s_z,
    s_y,
    D,
    eps,
    BD: tl.constexpr,
    XDT: tl.constexpr,
    PDT: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    rd = tl.arange(0, BD)
    m = rd < D
    x = tl.load(x_ptr + r * s_x + rd, mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + r * s_z + rd, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + rd, mask=m, other=0.0)
    # Arithmetic stays in float32; the casts only round where the reference rounds.
    y = _round(x * tl.rsqrt(tl.sum(x * x, 0) / D + eps), XDT)
    y = _round(w.to(tl.float32) * y, PDT)
    y = _round(y * (z * tl.sigmoid(z)), XDT)
    tl.store(y_ptr + r * s_y + rd, y.to(y_ptr.dtype.element_ty), mask=m)


def gated_rms_norm_triton(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton gated_rms_norm (see kernels.norm). Returns [..., D] in x's dtype."""
    if x.shape != z.shape or weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"x, z must be [..., D] and weight [D] (got x={tuple(x.shape)}, z={tuple(z.shape)}, weight={tuple(weight.shape)})"
        )
    for name, t in (("x", x), ("z", z), ("weight", weight)):
        if t.dtype not in _TL:
            raise ValueError(f"{name} must be float32, bfloat16 or float16 (got {name}={tuple(t.shape)}:{t.dtype})")
    check_same_device(x=x, z=z, weight=weight)
    D = x.shape[-1]
    x2, z2 = x.reshape(-1, D), z.reshape(-1, D)
    check_last_contiguous(x=x2, z=z2, weight=weight)
    y = torch.empty((x2.shape[0], D), dtype=x.dtype, device=x.device)
    if y.numel():
        _gated_rms_norm_kernel[(x2.shape[0],)](
            x2,
            z2,
            weight,
            y,
            x2.stride(0),
            z2.stride(0),
            y.stride(0),
            D,
            float(eps),
            BD=triton.next_power_of_2(D),
            XDT=_TL[x.dtype],
            PDT=_TL[torch.promote_types(weight.dtype, x.dtype)],
        )
    return y.view(x.shape)

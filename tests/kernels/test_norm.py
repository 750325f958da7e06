"""Fused gated RMSNorm: Triton vs the PyTorch reference (rounding where transformers rounds)."""

from __future__ import annotations

import pytest
import torch

from kernels.norm import gated_rms_norm
from tests.helpers.kernel_testing import DEVICE, TOL, assert_close, to_dev


@pytest.mark.parametrize(
    "dtypes",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
    ids=["f32", "bf16", "bf16-f32-weight"],
)
@pytest.mark.parametrize("shape", [(7, 4, 24), (1, 128), (65, 2, 32)], ids=["T7-Hv4-dv24", "T1-D128", "T65-Hv2-dv32"])
def test_gated_rms_norm_triton_matches_reference(shape, dtypes):
    from kernels.triton.norm import gated_rms_norm_triton

    dtype, wdtype = dtypes
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(dtype)
    z = torch.randn(shape, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(wdtype)
    y_ref = gated_rms_norm(x, z, w, 1e-6)
    y = gated_rms_norm_triton(*to_dev(x, z, w), 1e-6)
    assert y.dtype == y_ref.dtype
    assert_close("y", y, y_ref, TOL[dtype])


def test_gated_rms_norm_rejects_bad_shapes():
    from kernels.triton.norm import gated_rms_norm_triton

    with pytest.raises(ValueError, match=r"x=\(3, 8\), z=\(3, 8\), weight=\(4,\)"):
        gated_rms_norm_triton(
            torch.zeros(3, 8, device=DEVICE), torch.zeros(3, 8, device=DEVICE), torch.ones(4, device=DEVICE), 1e-6
        )

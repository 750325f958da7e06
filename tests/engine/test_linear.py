"""engine/model/linear.py: each GEMM layout gives F.linear's products (the independent
reference), keeps the weight it was given, and takes 1-D, 2-D, 3-D and strided inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.linear import Linear, gemm_kind
from kernels import cpu_ops

KINDS = ["native", "fp32"]
if cpu_ops.available(torch.float32):
    KINDS.append("packed")
if gemm_kind(torch.bfloat16, torch.device("cpu")) == "onednn":
    KINDS.append("onednn")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(1024, 256), (8, 2048), (2048, 2048)], ids=str)
def test_layouts_match_f_linear(kind, shape):
    g = torch.Generator().manual_seed(0)
    dtype = torch.float32 if kind == "packed" else torch.bfloat16
    w = (torch.randn(shape, generator=g) * 0.05).to(dtype)
    lin = Linear(w, kind)
    assert torch.equal(lin.weight, w)
    for rows in (1, 5, 12, 16, 23, 300):  # tiles of every height (6 rows, or 12 with AVX-512)
        x = torch.randn(rows, shape[1], generator=g).to(dtype)
        ref = F.linear(x.float(), w.float())
        got = lin(x)
        assert got.dtype == dtype and got.shape == (rows, shape[0])
        tol = 1e-4 if dtype == torch.float32 else 2e-2 * ref.abs().max().item()
        assert (got.float() - ref).abs().max().item() <= tol
        if kind == "onednn":  # the reordered weight gives F.linear's own bfloat16 output, bit for bit
            assert torch.equal(got, F.linear(x, w))
    x3 = torch.randn(2, 3, shape[1], generator=g).to(dtype)
    assert torch.equal(lin(x3), lin(x3.reshape(6, -1)).view(2, 3, -1))
    xs = torch.randn(4, 2, shape[1], generator=g).to(dtype)[:, 1]  # rows with a stride
    assert torch.equal(lin(xs), lin(xs.contiguous()))

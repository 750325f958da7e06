"""The batch-invariant GEMM (kernels/triton/gemm_invariant.py) on tiny shapes under Triton's
interpreter, realistic ones on a GPU: within rounding of a float32 matmul, and each output row the
same bits at M = 1, 3, 17, 64 and beside other rows, which is what batch-invariant mode needs of
it; `Linear` kind "invariant" and `row_invariant` on CUDA; the routed experts' row-invariant
blocks (kernels/triton/moe.py)."""

from __future__ import annotations

import pytest
import torch

from engine.model.linear import Linear, row_invariant
from kernels.gemm import gemm_invariant, gemm_invariant_ref
from kernels.moe import fused_moe
from kernels.triton.gemm_invariant import gemm_invariant_triton
from kernels.triton.moe import fused_moe_triton
from tests.helpers.kernel_testing import DEVICE, TOL, assert_close, assert_unchanged, to_dev
from tests.kernels.test_moe import make_case

# (N, K): one tile of columns and two steps over K with a partial last one; several of each
SHAPES = [pytest.param((40, 72), id="N40-K72"), pytest.param((70, 130), id="N70-K130")]
DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.bfloat16, id="bf16")]
ROWS = (1, 3, 17, 64)


def _case(N: int, K: int, dtype, seed: int, rows: int = 96) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, K, generator=g).to(dtype), (torch.randn(N, K, generator=g) * 0.1).to(dtype)


def _check_rows(gemm, x: torch.Tensor, w: torch.Tensor) -> None:
    """Every row's bits in `gemm(x[:64])` again at each M of ROWS, at both ends of the 64, and
    beside other rows in another order (x[64:] and the 64 reversed)."""
    whole = gemm(x[:64], w)
    for m in ROWS:
        for start in sorted({0, 64 - m}):
            assert_unchanged(
                f"rows {start}:{start + m} at M={m}", gemm(x[start : start + m], w), whole[start : start + m]
            )
    order = torch.arange(63, -1, -1)
    mixed = gemm(torch.cat([x[64:81], x[:64][order]]), w)
    assert_unchanged("rows beside others, reversed", mixed[17:], whole[order])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gemm_matches_float32_matmul(shape, dtype):
    x, w = _case(*shape, dtype, seed=1)
    got = gemm_invariant_triton(*to_dev(x[:17], w))
    assert got.dtype == dtype and got.shape == (17, shape[0])
    assert_close("y", got, x[:17].double() @ w.double().T, TOL[dtype])
    assert_close("reference", gemm_invariant_ref(x[:17], w), x[:17].double() @ w.double().T, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gemm_rows_are_the_same_bits_at_any_row_count(shape, dtype):
    x, w = _case(*shape, dtype, seed=2)
    _check_rows(gemm_invariant_triton, *to_dev(x, w))


def test_gemm_checks_its_arguments():
    x, w = to_dev(*_case(8, 16, torch.bfloat16, seed=3, rows=4))
    with pytest.raises(ValueError, match=r"x must be \[M, K\] and w \[N, K\] \(got x=\(4, 16\), w=\(8, 15\)\)"):
        gemm_invariant_triton(x, w[:, :15])
    with pytest.raises(ValueError, match="share a dtype"):
        gemm_invariant_triton(x, w.float())
    with pytest.raises(ValueError, match="unit stride"):
        gemm_invariant_triton(x.T.contiguous().T, w)
    assert gemm_invariant_triton(x[:0], w).shape == (0, 8)


def test_invariant_linear_runs_the_kernel(monkeypatch):
    """Linear kind "invariant" (what `row_invariant` gives on CUDA) keeps its weight as it is and
    multiplies through `gemm_invariant`, 3-D inputs too; here through the interpreter."""
    monkeypatch.setenv("PDSERVE_FORCE_TRITON", "1")
    x, w = to_dev(*_case(40, 72, torch.bfloat16, seed=4))
    lin = Linear(w, "invariant")
    assert lin.kind == "invariant" and torch.equal(lin.weight, w)
    whole = lin(x[:64])
    assert torch.equal(whole, gemm_invariant(x[:64], w))
    assert torch.equal(lin(x[:6].view(2, 3, 72)), whole[:6].view(2, 3, 40))
    assert torch.equal(lin(x[5:6]), whole[5:6])
    with pytest.raises(ValueError, match="not torch.float16 on"):
        row_invariant(Linear(w.half()))


def test_experts_row_invariant_give_each_token_the_same_bits(monkeypatch):
    """fused_moe_triton with row_invariant: a token's output is the same bits in a batch of 24,
    in slices of 5 and alone, and within rounding of the PyTorch path."""
    T = 24
    x, w13, w2, tw, ti = make_case(T, 32, 16, 4, 2, torch.bfloat16, seed=5)
    ref = fused_moe(x, w13, w2, tw, ti)
    x, w13, w2, tw, ti = to_dev(x, w13, w2, tw, ti)

    def moe(s: slice) -> torch.Tensor:
        return fused_moe_triton(x[s], w13, w2, tw[s], ti[s], row_invariant=True)

    whole = moe(slice(0, T))
    assert_close("out", whole, ref, TOL[torch.bfloat16])
    for s in range(0, T, 5):
        assert_unchanged(f"tokens {s}:{s + 5}", moe(slice(s, s + 5)), whole[s : s + 5])
    for i in (0, 13, T - 1):
        assert_unchanged(f"token {i} alone", moe(slice(i, i + 1)), whole[i : i + 1])
    monkeypatch.setenv("PDSERVE_FORCE_TRITON", "1")  # the op passes the flag on to the kernels
    assert_unchanged("fused_moe", fused_moe(x[:5], w13, w2, tw[:5], ti[:5], row_invariant=True), whole[:5])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "NK", [(4096, 2048), (2048, 6144), (1000, 300)], ids=["N4096-K2048", "N2048-K6144", "N1000-K300"]
)
def test_gemm_rows_are_the_same_bits_on_cuda(NK, dtype):
    """Compiled on the GPU: the same checks at Qwen3.5's projection sizes (and ragged ones), and
    `row_invariant` on a CUDA Linear gives kind "invariant"."""
    x, w = (t.cuda() for t in _case(*NK, dtype, seed=6, rows=300))
    assert_close("y", gemm_invariant_triton(x, w), x.double() @ w.double().T, TOL[dtype])
    _check_rows(gemm_invariant_triton, x, w)
    whole = gemm_invariant_triton(x, w)
    for m in (1, 2, 5, 100, 129, 300):  # past one tile of rows too
        assert_unchanged(f"M={m}", gemm_invariant_triton(x[300 - m :], w), whole[300 - m :])
    lin = row_invariant(Linear(w))
    assert lin.kind == "invariant" and torch.equal(lin(x[7:8]), whole[7:8])


@pytest.mark.gpu
def test_experts_row_invariant_on_cuda():
    x, w13, w2, tw, ti = (t.to(DEVICE) for t in make_case(300, 2048, 256, 64, 8, torch.bfloat16, seed=7))
    whole = fused_moe(x, w13, w2, tw, ti, row_invariant=True)
    for s, n in ((0, 1), (17, 3), (100, 64), (150, 150)):
        got = fused_moe(x[s : s + n], w13, w2, tw[s : s + n], ti[s : s + n], row_invariant=True)
        assert_unchanged(f"tokens {s}:{s + n}", got, whole[s : s + n])

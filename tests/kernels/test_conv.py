"""Causal conv1d (varlen prefill, multi-token decode rows, 1-token update): Triton vs the
PyTorch reference, the reference vs the naive loop, rollback, and untouched slots."""

from __future__ import annotations

import pytest
import torch

from kernels.conv import causal_conv1d, causal_conv1d_update
from kernels.naive import naive_conv
from tests.helpers.kernel_cases import DTYPES, KC, LENGTHS, conv_case
from tests.helpers.kernel_testing import (
    DEVICE,
    NAIVE_TOL,
    TOL,
    assert_close,
    assert_unchanged,
    cu_seqlens,
    nan_like,
    to_dev,
)

# conv_dim = 2*Hk*dk + Hv*dv: (Hk=2, dk=16, Hv=4, dv=24) -> 160 (not a power of two), and a small one.
DIMS = [pytest.param(160, id="D160"), pytest.param(40, id="D40")]
PREFILL_BATCHES = [pytest.param([n], id=f"len{n}") for n in LENGTHS] + [
    pytest.param([65, 1, 130, 2, 7, 64, 63], id="mixed-lens")
]
DECODE_BATCHES = [
    pytest.param([1, 1, 1], id="plain"),
    pytest.param([4, 4], id="spec-k3"),
    pytest.param([1, 4, 1, 4, 1], id="mixed-plain-and-k3"),
    pytest.param([2, 1, 5, 1, 3], id="mixed-k1-k2-k4"),
]


@pytest.mark.parametrize("length", LENGTHS, ids=lambda n: f"len{n}")
def test_conv_reference_matches_naive(length):
    x, w, cu, pool0, slots, _, has_init = conv_case([length, 2, 5], 40, torch.float32, has_init=[True, False, False])
    pool = pool0.clone()
    y = causal_conv1d(x, w, cu, pool, slots, has_init)
    for b in range(3):
        s, e = int(cu[b]), int(cu[b + 1])
        y_n, st_n = naive_conv(x[s:e], w, pool0[slots[b]] if has_init[b] else None)
        assert_close(f"y row {b}", y[s:e], y_n, NAIVE_TOL)
        assert_close(f"state row {b}", pool[slots[b]], st_n, NAIVE_TOL)


@pytest.mark.parametrize("activation", [True, False], ids=["silu", "linear"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", DIMS)
@pytest.mark.parametrize("lens", PREFILL_BATCHES)
def test_conv_prefill_triton_matches_reference(lens, D, dtype, activation):
    from kernels.triton.conv import causal_conv1d_triton

    x, w, cu, pool0, slots, others, has_init = conv_case(lens, D, dtype, seed=1)
    pool_ref = pool0.clone()
    y_ref = causal_conv1d(x, w, cu, pool_ref, slots, has_init, activation)
    pool = pool0.clone().to(DEVICE)
    out = nan_like(y_ref).to(DEVICE)
    y = causal_conv1d_triton(*to_dev(x, w, cu), pool, *to_dev(slots, has_init), activation, out=out)
    assert y is out
    assert_close("y", y, y_ref, TOL[dtype])
    assert_close("conv state", pool.cpu()[slots], pool_ref[slots], TOL[dtype])
    assert_unchanged("slots not in the batch", pool.cpu()[others], pool0[others])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens", DECODE_BATCHES)
def test_conv_decode_rows_with_intermediate_states(lens, dtype):
    from kernels.triton.conv import causal_conv1d_triton

    D = 160
    x, w, cu, pool0, slots, others, _ = conv_case(lens, D, dtype, seed=2, has_init=[True] * len(lens))
    inter_ref = torch.full((len(lens), max(lens) + 1, D, KC - 1), float("nan"), dtype=dtype)
    pool_ref = pool0.clone()
    y_ref = causal_conv1d(x, w, cu, pool_ref, slots, intermediate_states=inter_ref)
    pool = pool0.clone().to(DEVICE)
    inter = nan_like(inter_ref).to(DEVICE)
    y = causal_conv1d_triton(
        *to_dev(x, w, cu), pool, slots.to(DEVICE), intermediate_states=inter, out=nan_like(y_ref).to(DEVICE)
    )
    assert_close("y", y, y_ref, TOL[dtype])
    assert_close("conv state", pool.cpu()[slots], pool_ref[slots], TOL[dtype])
    assert_unchanged("slots not in the batch", pool.cpu()[others], pool0[others])
    inter = inter.cpu()
    for b, n in enumerate(lens):
        assert_close(f"intermediate states row {b}", inter[b, :n], inter_ref[b, :n], TOL[dtype])
        assert_unchanged(f"intermediate entries past row {b}'s {n} tokens", inter[b, n:], inter_ref[b, n:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_update_triton_matches_reference(dtype):
    from kernels.triton.conv import causal_conv1d_update_triton

    x, w, _, pool0, slots, others, _ = conv_case([1] * 5, 160, dtype, seed=3, has_init=[True] * 5)
    inter_ref = torch.full((5, 2, 160, KC - 1), float("nan"), dtype=dtype)
    pool_ref = pool0.clone()
    y_ref = causal_conv1d_update(x, w, pool_ref, slots, intermediate_states=inter_ref)
    pool = pool0.clone().to(DEVICE)
    inter = nan_like(inter_ref).to(DEVICE)
    y = causal_conv1d_update_triton(
        *to_dev(x, w), pool, slots.to(DEVICE), intermediate_states=inter, out=nan_like(y_ref).to(DEVICE)
    )
    assert_close("y", y, y_ref, TOL[dtype])
    assert_close("conv state", pool.cpu()[slots], pool_ref[slots], TOL[dtype])
    assert_unchanged("slots not in the batch", pool.cpu()[others], pool0[others])
    assert_close("intermediate states", inter.cpu()[:, 0], inter_ref[:, 0], TOL[dtype])
    assert_unchanged("intermediate entries past the token", inter.cpu()[:, 1:], inter_ref[:, 1:])


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_conv_rollback_to_accepted_prefix(impl):
    """Rows of k+1 = 4 tokens mixed with plain rows; accept j tokens per row and copy
    intermediate_states[b, j-1] into the slot: equal to feeding only the j tokens."""
    if impl == "triton":
        from kernels.triton.conv import causal_conv1d_triton as op
    else:
        op = causal_conv1d
    dev = DEVICE if impl == "triton" else "cpu"
    lens, accept = [1, 4, 4, 1, 4], [1, 1, 2, 1, 3]
    x, w, cu, pool0, slots, others, _ = conv_case(lens, 160, torch.float32, seed=4, has_init=[True] * 5)
    x, w, slots_d = x.to(dev), w.to(dev), slots.to(dev)
    pool_a = pool0.clone().to(dev)
    inter = torch.full((5, 4, 160, KC - 1), float("nan"), device=dev)
    op(x, w, cu.to(dev), pool_a, slots_d, intermediate_states=inter)
    for b, j in enumerate(accept):
        pool_a[slots_d[b]] = inter[b, j - 1]
    keep = torch.cat([torch.arange(int(s), int(s) + j) for s, j in zip(cu[:-1], accept)]).to(dev)
    pool_b = pool0.clone().to(dev)
    op(x[keep], w, cu_seqlens(accept).to(dev), pool_b, slots_d)
    assert_unchanged("rolled-back conv state", pool_a.cpu()[slots], pool_b.cpu()[slots])
    assert torch.isfinite(pool_a.cpu()[slots]).all()
    assert_unchanged("slots not in the batch", pool_a.cpu()[others], pool0[others])


def test_conv_wrappers_reject_bad_arguments():
    from kernels.triton.conv import causal_conv1d_triton, causal_conv1d_update_triton

    x, w, cu, pool, slots, _, _ = conv_case([3, 2], 40, torch.float32)
    with pytest.raises(ValueError, match=r"conv_pool must be \[S, D=40, Kc-1=3\].*conv_pool=\(5, 3, 40\)"):
        causal_conv1d_triton(x, w, cu, pool.transpose(1, 2).contiguous(), slots)
    with pytest.raises(ValueError, match=r"conv_pool must be contiguous in time"):
        causal_conv1d_triton(x, w, cu, pool.transpose(1, 2).contiguous().transpose(1, 2), slots)
    with pytest.raises(
        ValueError, match=r"intermediate_states must be \[B=2, n>=3, D=40, Kc-1=3\].*got \(2, 3, 3, 40\)"
    ):
        causal_conv1d_triton(x, w, cu, pool, slots, intermediate_states=torch.zeros(2, 3, 3, 40))
    with pytest.raises(ValueError, match=r"x must be \[T, D\] and weight \[D, Kc\].*weight=\(4, 40\)"):
        causal_conv1d_update_triton(x[:2], w.T.contiguous(), pool, slots)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_prefill_triton_large(dtype):
    from kernels.triton.conv import causal_conv1d_triton

    D = 2 * 16 * 128 + 32 * 128  # Qwen3.5-sized conv_dim
    lens = [300, 1, 3, 129]
    x, w, cu, pool0, slots, others, has_init = conv_case(lens, D, dtype, seed=5)
    inter_ref = torch.full((4, 300, D, KC - 1), float("nan"), dtype=dtype)
    pool_ref = pool0.clone()
    y_ref = causal_conv1d(x, w, cu, pool_ref, slots, has_init, intermediate_states=inter_ref)
    pool = pool0.clone().to(DEVICE)
    inter = nan_like(inter_ref).to(DEVICE)
    y = causal_conv1d_triton(*to_dev(x, w, cu), pool, *to_dev(slots, has_init), intermediate_states=inter)
    assert_close("y", y, y_ref, TOL[dtype])
    assert_close("conv state", pool.cpu()[slots], pool_ref[slots], TOL[dtype])
    assert_unchanged("slots not in the batch", pool.cpu()[others], pool0[others])
    for b, n in enumerate(lens):
        assert_close(f"intermediate states row {b}", inter.cpu()[b, :n], inter_ref[b, :n], TOL[dtype])

"""GDN chunked prefill and recurrent decode: Triton vs the PyTorch reference, the reference vs
the naive per-token loop, speculative rollback, and what the kernels may and may not write."""

from __future__ import annotations

import pytest
import torch

import kernels.gdn
from kernels.gdn import gdn_chunk_prefill, gdn_recurrent
from kernels.naive import naive_gdn
from tests.helpers.kernel_cases import DTYPES, LENGTHS, STATE_TOL, GDNCase, check_pool, gdn_case
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

# (Hk, Hv, dk, dv): Hv = Hk and Hv = 2 Hk, dk != dv in both.
HEADS = [
    pytest.param((2, 2, 32, 24), id="hv=hk-dk32-dv24"),
    pytest.param((2, 4, 16, 32), id="hv=2hk-dk16-dv32"),
]
PREFILL_BATCHES = [pytest.param([n], id=f"len{n}") for n in LENGTHS] + [
    pytest.param([65, 1, 130, 7, 64, 63], id="mixed-lens")
]
# Decode rows: 1 token (plain decode) or k+1 tokens (verifying k draft tokens), mixed freely.
DECODE_BATCHES = [
    pytest.param([1, 1, 1, 1], id="plain"),
    pytest.param([4, 4, 4], id="spec-k3"),
    pytest.param([1, 4, 1, 4, 1], id="mixed-plain-and-k3"),
    pytest.param([2, 1, 5, 1, 3], id="mixed-k1-k2-k4"),
]


# ---------------------------------------------------------------- reference vs naive loop


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("length", LENGTHS, ids=lambda n: f"len{n}")
def test_chunk_reference_matches_naive(length, heads):
    c = gdn_case([length, 5], heads, torch.float32, seed=1, has_init=[True, False])
    pool = c.pool.clone()
    o = gdn_chunk_prefill(c.q, c.k, c.v, c.g, c.beta, c.cu, pool, c.slots, c.has_init)
    _compare_naive(c, o, pool)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("lens", DECODE_BATCHES)
def test_recurrent_reference_matches_naive(lens, heads):
    c = gdn_case(lens, heads, torch.float32, seed=2)
    pool = c.pool.clone()
    inter = torch.full((len(lens), max(lens), *c.pool.shape[1:]), float("nan"))
    o = gdn_recurrent(c.q, c.k, c.v, c.g, c.beta, c.cu, pool, c.slots, c.has_init, intermediate_states=inter)
    _compare_naive(c, o, pool)
    for b, n in enumerate(lens):  # state after every token: the naive loop over a prefix
        s, init = int(c.cu[b]), (c.pool[c.slots[b]] if c.has_init[b] else None)
        for t in range(n):
            _, st = naive_gdn(
                c.q[s : s + t + 1],
                c.k[s : s + t + 1],
                c.v[s : s + t + 1],
                c.g[s : s + t + 1],
                c.beta[s : s + t + 1],
                init,
            )
            assert_close(f"intermediate state row {b} token {t}", inter[b, t], st, NAIVE_TOL)
        assert torch.isnan(inter[b, n:]).all(), f"row {b}: intermediate entries past its {n} tokens were written"


def _compare_naive(c: GDNCase, o, pool):
    for b in range(len(c.slots)):
        s, e = int(c.cu[b]), int(c.cu[b + 1])
        init = c.pool[c.slots[b]] if c.has_init[b] else None
        o_n, s_n = naive_gdn(c.q[s:e], c.k[s:e], c.v[s:e], c.g[s:e], c.beta[s:e], init)
        assert_close(f"o row {b}", o[s:e], o_n, NAIVE_TOL)
        assert_close(f"state row {b}", pool[c.slots[b]], s_n, NAIVE_TOL)


# ---------------------------------------------------------------- Triton vs reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("lens", PREFILL_BATCHES)
def test_chunk_prefill_triton_matches_reference(lens, heads, dtype):
    from kernels.triton.gdn_chunk import gdn_chunk_prefill_triton

    c = gdn_case(lens, heads, dtype, seed=3)
    pool_ref = c.pool.clone()
    o_ref = gdn_chunk_prefill(c.q, c.k, c.v, c.g, c.beta, c.cu, pool_ref, c.slots, c.has_init)

    pool, slots, has_init = to_dev(c.pool.clone(), c.slots, c.has_init)
    out = nan_like(o_ref).to(DEVICE)  # every element must be written
    o = gdn_chunk_prefill_triton(*c.args(DEVICE), pool, slots, has_init, out=out)
    assert o is out
    assert_close("o", o, o_ref, TOL[dtype])
    check_pool("chunk prefill", pool, pool_ref, c.pool, c)


@pytest.mark.parametrize("chunk_size", [16, 32], ids=lambda c: f"chunk{c}")
def test_chunk_prefill_triton_other_chunk_sizes(chunk_size):
    from kernels.triton.gdn_chunk import gdn_chunk_prefill_triton

    c = gdn_case([65, 7, 33], (2, 4, 16, 32), torch.float32, seed=4)
    pool_ref = c.pool.clone()
    o_ref = gdn_chunk_prefill(c.q, c.k, c.v, c.g, c.beta, c.cu, pool_ref, c.slots, c.has_init)
    pool, slots, has_init = to_dev(c.pool.clone(), c.slots, c.has_init)
    o = gdn_chunk_prefill_triton(*c.args(DEVICE), pool, slots, has_init, chunk_size=chunk_size)
    assert_close("o", o, o_ref, TOL[torch.float32])
    check_pool("chunk prefill", pool, pool_ref, c.pool, c)


def test_chunk_prefill_triton_strong_decay_and_no_has_initial_state():
    """Near-zero alpha (g down to -30) within a chunk, and has_initial_state=None (all read)."""
    from kernels.triton.gdn_chunk import gdn_chunk_prefill_triton

    c = gdn_case([130, 40], (2, 2, 32, 24), torch.float32, seed=5, has_init=[True, True])
    g = c.g * torch.linspace(1, 30, c.g.shape[0])[:, None]
    pool_ref = c.pool.clone()
    o_ref = gdn_chunk_prefill(c.q, c.k, c.v, g, c.beta, c.cu, pool_ref, c.slots)
    pool, slots = to_dev(c.pool.clone(), c.slots)
    q, k, v, _, beta, cu = c.args(DEVICE)
    o = gdn_chunk_prefill_triton(q, k, v, g.to(DEVICE), beta, cu, pool, slots)
    assert_close("o", o, o_ref, TOL[torch.float32])
    check_pool("chunk prefill", pool, pool_ref, c.pool, c)


@pytest.mark.parametrize("with_inter", [True, False], ids=["intermediate", "no-intermediate"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("lens", DECODE_BATCHES)
def test_recurrent_triton_matches_reference(lens, heads, dtype, with_inter):
    from kernels.triton.gdn_recurrent import gdn_recurrent_triton

    c = gdn_case(lens, heads, dtype, seed=6)
    n_max = max(lens) + 1  # scratch longer than any row: the tail must stay untouched
    inter_ref = torch.full((len(lens), n_max, *c.pool.shape[1:]), float("nan")) if with_inter else None
    pool_ref = c.pool.clone()
    o_ref = gdn_recurrent(
        c.q, c.k, c.v, c.g, c.beta, c.cu, pool_ref, c.slots, c.has_init, intermediate_states=inter_ref
    )

    pool, slots, has_init = to_dev(c.pool.clone(), c.slots, c.has_init)
    inter = nan_like(inter_ref).to(DEVICE) if with_inter else None
    out = nan_like(o_ref).to(DEVICE)
    o = gdn_recurrent_triton(*c.args(DEVICE), pool, slots, has_init, intermediate_states=inter, out=out)
    assert o is out
    assert_close("o", o, o_ref, TOL[dtype])
    check_pool("recurrent", pool, pool_ref, c.pool, c)
    if with_inter:
        inter = inter.cpu()
        for b, n in enumerate(lens):
            assert_close(f"intermediate states row {b}", inter[b, :n], inter_ref[b, :n], STATE_TOL)
            assert_unchanged(f"intermediate entries past row {b}'s {n} tokens", inter[b, n:], inter_ref[b, n:])


def test_recurrent_triton_continues_chunk_prefill():
    """Prefill a prompt with the chunk kernel, decode with the recurrent one: same as one prefill."""
    from kernels.triton.gdn_chunk import gdn_chunk_prefill_triton
    from kernels.triton.gdn_recurrent import gdn_recurrent_triton

    lens = [70, 9]
    c = gdn_case([n + 3 for n in lens], (2, 4, 16, 32), torch.float32, seed=7, has_init=[False, True])
    pool_ref = c.pool.clone()
    o_ref = gdn_chunk_prefill(c.q, c.k, c.v, c.g, c.beta, c.cu, pool_ref, c.slots, c.has_init)

    starts = c.cu[:-1]
    pre = torch.cat([torch.arange(int(s), int(s) + n) for s, n in zip(starts, lens)])
    dec = torch.cat([torch.arange(int(s) + n, int(s) + n + 3) for s, n in zip(starts, lens)])
    pool, slots, has_init = to_dev(c.pool.clone(), c.slots, c.has_init)
    t = [x.to(DEVICE) for x in (c.q, c.k, c.v, c.g, c.beta)]
    o1 = gdn_chunk_prefill_triton(*(x[pre] for x in t), cu_seqlens(lens).to(DEVICE), pool, slots, has_init)
    o2 = gdn_recurrent_triton(*(x[dec] for x in t), cu_seqlens([3, 3]).to(DEVICE), pool, slots)
    assert_close("prefill part", o1, o_ref[pre], TOL[torch.float32])
    assert_close("decode part", o2, o_ref[dec], TOL[torch.float32])
    check_pool("prefill then decode", pool, pool_ref, c.pool, c)


# ---------------------------------------------------------------- speculative rollback


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("heads", HEADS)
def test_rollback_to_accepted_prefix(heads, impl):
    """Verify k=3 draft tokens (rows of k+1 = 4 tokens, mixed with plain rows), accept j of the
    fed tokens per row, copy intermediate_states[b, j-1] into the slot: the state equals that of
    feeding only the j accepted tokens."""
    if impl == "triton":
        from kernels.triton.gdn_recurrent import gdn_recurrent_triton as op
    else:
        op = gdn_recurrent
    dev = DEVICE if impl == "triton" else "cpu"
    lens, accept = [1, 4, 4, 1, 4], [1, 1, 2, 1, 3]
    c = gdn_case(lens, heads, torch.float32, seed=8, has_init=[True] * 5)
    t = [x.to(dev) for x in (c.q, c.k, c.v, c.g, c.beta)]
    slots = c.slots.to(dev)

    pool_a = c.pool.clone().to(dev)
    inter = torch.full((5, 4, *c.pool.shape[1:]), float("nan"), device=dev)
    op(*t, c.cu.to(dev), pool_a, slots, intermediate_states=inter)
    for b, j in enumerate(accept):
        pool_a[slots[b]] = inter[b, j - 1]

    keep = torch.cat([torch.arange(int(s), int(s) + j) for s, j in zip(c.cu[:-1], accept)]).to(dev)
    pool_b = c.pool.clone().to(dev)
    op(*(x[keep] for x in t), cu_seqlens(accept).to(dev), pool_b, slots)

    diff = (pool_a.cpu()[c.slots] - pool_b.cpu()[c.slots]).abs().max().item()
    assert torch.isfinite(pool_a.cpu()[c.slots]).all() and diff <= 1e-6, f"rolled-back state differs by {diff:.3e}"
    assert_unchanged("slots not in the batch", pool_a.cpu()[c.others], c.pool[c.others])


# ---------------------------------------------------------------- wrappers and dispatch


def test_wrappers_reject_bad_arguments():
    from kernels.triton.gdn_chunk import gdn_chunk_prefill_triton
    from kernels.triton.gdn_recurrent import gdn_recurrent_triton

    c = gdn_case([3, 2], (2, 4, 16, 32), torch.float32)
    a = (c.q, c.k, c.v, c.g, c.beta, c.cu)
    with pytest.raises(ValueError, match=r"v=\(5, 3, 32\)"):
        gdn_chunk_prefill_triton(c.q, c.k, c.v[:, :3], c.g, c.beta, c.cu, c.pool, c.slots)
    with pytest.raises(ValueError, match=r"state_pool=\(5, 4, 32, 16\)"):
        gdn_recurrent_triton(*a, c.pool.transpose(-1, -2), c.slots)
    with pytest.raises(ValueError, match=r"intermediate_states must be float32 \[B=2, n>=3.*got \(2, 2, 4, 16, 32\)"):
        gdn_recurrent_triton(*a, c.pool, c.slots, intermediate_states=torch.zeros(2, 2, 4, 16, 32))
    with pytest.raises(ValueError, match=r"has_initial_state must be a bool tensor \[B=2\].*\(2,\):int64"):
        gdn_recurrent_triton(*a, c.pool, c.slots, has_initial_state=torch.ones(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"q must have unit stride.*strides \(1, 5, 10\)"):
        qt = c.q.permute(2, 1, 0).contiguous().permute(2, 1, 0)
        gdn_chunk_prefill_triton(qt, c.k, c.v, c.g, c.beta, c.cu, c.pool, c.slots)
    with pytest.raises(ValueError, match=r"slot_ids must be a 1-D int32/int64 tensor.*float32"):
        gdn_chunk_prefill_triton(*a, c.pool, c.slots.float())
    with pytest.raises(ValueError, match=r"chunk_size must be a power of two >= 16 \(got 24\)"):
        gdn_chunk_prefill_triton(*a, c.pool, c.slots, chunk_size=24)
    with pytest.raises(ValueError, match=r"out must be \(5, 4, 32\):float32"):
        gdn_chunk_prefill_triton(*a, c.pool, c.slots, out=torch.empty(5, 4, 32, dtype=torch.bfloat16))


def test_ops_dispatch_to_triton_when_forced(monkeypatch):
    import kernels.triton.gdn_chunk as tc
    import kernels.triton.gdn_recurrent as tr

    calls = []
    monkeypatch.setattr(tc, "gdn_chunk_prefill_triton", lambda *a, **kw: calls.append("chunk"))
    monkeypatch.setattr(tr, "gdn_recurrent_triton", lambda *a, **kw: calls.append("recurrent"))
    c = gdn_case([3], (2, 2, 16, 16), torch.float32)
    args = (c.q, c.k, c.v, c.g, c.beta, c.cu, c.pool.clone(), c.slots)
    kernels.gdn.gdn_chunk_prefill(*args)
    assert calls == []  # CPU tensors take the PyTorch path
    monkeypatch.setenv("PDSERVE_FORCE_TRITON", "1")
    kernels.gdn.gdn_chunk_prefill(*args)
    kernels.gdn.gdn_recurrent(*args)
    assert calls == ["chunk", "recurrent"]


# ---------------------------------------------------------------- slow tier: model-sized heads


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunk_prefill_triton_large(dtype):
    from kernels.triton.gdn_chunk import gdn_chunk_prefill_triton

    c = gdn_case([300, 1, 129, 64], (4, 8, 128, 128), dtype, seed=9)
    pool_ref = c.pool.clone()
    o_ref = gdn_chunk_prefill(c.q, c.k, c.v, c.g, c.beta, c.cu, pool_ref, c.slots, c.has_init)
    pool, slots, has_init = to_dev(c.pool.clone(), c.slots, c.has_init)
    o = gdn_chunk_prefill_triton(*c.args(DEVICE), pool, slots, has_init, out=nan_like(o_ref).to(DEVICE))
    assert_close("o", o, o_ref, TOL[dtype])
    check_pool("chunk prefill", pool, pool_ref, c.pool, c)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_recurrent_triton_large(dtype):
    from kernels.triton.gdn_recurrent import gdn_recurrent_triton

    lens = [1, 5, 1, 1, 5, 3, 1, 5]
    c = gdn_case(lens, (4, 8, 128, 128), dtype, seed=10)
    inter_ref = torch.full((len(lens), 5, *c.pool.shape[1:]), float("nan"))
    pool_ref = c.pool.clone()
    o_ref = gdn_recurrent(
        c.q, c.k, c.v, c.g, c.beta, c.cu, pool_ref, c.slots, c.has_init, intermediate_states=inter_ref
    )
    pool, slots, has_init = to_dev(c.pool.clone(), c.slots, c.has_init)
    inter = nan_like(inter_ref).to(DEVICE)
    o = gdn_recurrent_triton(*c.args(DEVICE), pool, slots, has_init, intermediate_states=inter)
    assert_close("o", o, o_ref, TOL[dtype])
    check_pool("recurrent", pool, pool_ref, c.pool, c)
    for b, n in enumerate(lens):
        assert_close(f"intermediate states row {b}", inter.cpu()[b, :n], inter_ref[b, :n], STATE_TOL)

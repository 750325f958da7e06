"""GDN kernels with a bfloat16 recurrent-state pool (--mamba-ssm-cache-dtype bfloat16): the
PyTorch path and the Triton kernels (the interpreter without a GPU) load the state, compute in
float32 and store in the pool's dtype. Reference: the naive float64 loop started from the
pool's bfloat16 values, its final state rounded to bfloat16 once."""

from __future__ import annotations

import pytest
import torch

from kernels.gdn import gdn_chunk_prefill, gdn_recurrent
from kernels.naive import naive_gdn
from tests.helpers.kernel_cases import GDNCase, gdn_case
from tests.helpers.kernel_testing import DEVICE, assert_close, assert_unchanged, to_dev

HEADS = (2, 4, 16, 32)
O_TOL = 2e-2  # outputs: the initial state is the pool's bfloat16 in both, the rest float32
STATE_TOL = 1e-2  # stored states: one bfloat16 rounding (2^-8) on each side


def _bf16_case(lens, seed):
    c = gdn_case(lens, HEADS, torch.float32, seed=seed)
    c.pool = c.pool.to(torch.bfloat16)
    return c


def _check(c: GDNCase, o, pool, name):
    pool = pool.cpu()
    assert pool.dtype == torch.bfloat16
    for b in range(len(c.slots)):
        s, e = int(c.cu[b]), int(c.cu[b + 1])
        init = c.pool[c.slots[b]].float() if c.has_init[b] else None
        o_n, s_n = naive_gdn(c.q[s:e], c.k[s:e], c.v[s:e], c.g[s:e], c.beta[s:e], init)
        assert_close(f"{name} o row {b}", o[s:e].cpu(), o_n, O_TOL)
        assert_close(f"{name} state row {b}", pool[c.slots[b]], s_n.to(torch.bfloat16), STATE_TOL)
    assert_unchanged(f"{name}: slots not in the batch", pool[c.others], c.pool[c.others])


def _run(fn, c, **kw):
    """The PyTorch path on the CPU."""
    pool = c.pool.clone()
    return fn(*c.args(), pool, c.slots, c.has_init, **kw), pool


@pytest.mark.parametrize("lens", [[7, 65, 1], [130]], ids=["mixed", "len130"])
def test_chunk_prefill_bf16_pool_reference(lens):
    c = _bf16_case(lens, seed=11)
    o, pool = _run(gdn_chunk_prefill, c)
    _check(c, o, pool, "chunk prefill (PyTorch)")


@pytest.mark.parametrize("lens", [[1, 1, 1], [4, 1, 3]], ids=["plain", "spec"])
def test_recurrent_bf16_pool_reference_and_intermediate(lens):
    c = _bf16_case(lens, seed=12)
    inter = torch.full((len(lens), max(lens), *c.pool.shape[1:]), float("nan"), dtype=torch.bfloat16)
    o, pool = _run(gdn_recurrent, c, intermediate_states=inter)
    _check(c, o, pool, "recurrent (PyTorch)")
    for b, n in enumerate(lens):  # the kept state after a row's last token is the pool's
        assert_unchanged(f"row {b} last intermediate", inter[b, n - 1], pool[c.slots[b]])


def test_chunk_prefill_triton_bf16_pool():
    from kernels.triton.gdn_chunk import gdn_chunk_prefill_triton

    c = _bf16_case([7, 65, 1], seed=13)
    pool, slots, has_init = to_dev(c.pool.clone(), c.slots, c.has_init)
    o = gdn_chunk_prefill_triton(*c.args(DEVICE), pool, slots, has_init, None, 16)
    _check(c, o, pool, "chunk prefill (Triton)")


def test_recurrent_triton_bf16_pool_with_intermediate():
    from kernels.triton.gdn_recurrent import gdn_recurrent_triton

    lens = [4, 1, 3]
    c = _bf16_case(lens, seed=14)
    pool, slots, has_init = to_dev(c.pool.clone(), c.slots, c.has_init)
    inter = torch.full((len(lens), 4, *c.pool.shape[1:]), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    o = gdn_recurrent_triton(*c.args(DEVICE), pool, slots, has_init, intermediate_states=inter)
    _check(c, o, pool, "recurrent (Triton)")
    inter = inter.cpu()
    for b, n in enumerate(lens):
        assert_unchanged(f"row {b} last intermediate", inter[b, n - 1], pool.cpu()[c.slots[b]])
        assert torch.isnan(inter[b, n:].float()).all(), f"row {b}: entries past its {n} tokens were written"
    wrong = torch.zeros_like(inter, dtype=torch.float32)
    with pytest.raises(ValueError, match="intermediate_states must be bfloat16"):
        gdn_recurrent_triton(*c.args(DEVICE), pool, slots, has_init, intermediate_states=wrong)


def test_state_pool_dtype_checked():
    c = gdn_case([3], HEADS, torch.float32)
    with pytest.raises(ValueError, match="state_pool must be float32 or bfloat16"):
        gdn_recurrent(*c.args(), c.pool.half(), c.slots, c.has_init)


# ---------------------------------------------------------------- the fused CPU operators


def _cpu_ops_case(lens, seed, hk=2, hv=4, dk=32, dv=32, S=9):
    g = torch.Generator().manual_seed(seed)
    D, T = 2 * hk * dk + hv * dv, sum(lens)
    proj = torch.randn(T, D + hv * dv + 2 * hv, generator=g)
    conv_w = torch.randn(D, 4, generator=g) * 0.5
    conv_pool = torch.randn(S, D, 3, generator=g)
    rec_pool = (torch.randn(S, hv, dk, dv, generator=g) * 0.1).to(torch.bfloat16)
    slots = torch.randperm(S, generator=g)[: len(lens)]
    rest = (-torch.rand(hv, generator=g) * 2, torch.randn(hv, generator=g), 1 + 0.1 * torch.randn(dv, generator=g))
    return proj, conv_w, conv_pool, rec_pool, slots, (*rest, hk, hv, dk, dv, 1e-6)


def _check_pools(name, conv_pool, rec_pool, conv_ref, rec_ref, slots, before):
    others = torch.tensor([s for s in range(rec_pool.shape[0]) if s not in slots.tolist()])
    assert rec_pool.dtype == torch.bfloat16
    assert_close(f"{name} conv states", conv_pool[slots], conv_ref[slots], 1e-6)
    assert_close(f"{name} recurrent states", rec_pool[slots], rec_ref[slots].to(torch.bfloat16), STATE_TOL)
    assert_unchanged(f"{name}: slots not in the batch", rec_pool[others], before[others])


def test_cpu_gdn_decode_on_a_bf16_pool():
    """The fused decode operator on a bfloat16 state against itself on the float32 state it holds
    (its float32 path is pinned to the PyTorch path in test_cpu_ops.py): one rounding apart."""
    from kernels import cpu_ops

    if not cpu_ops.available():
        pytest.skip(cpu_ops.status())
    proj, conv_w, conv_pool, rec_pool, slots, rest = _cpu_ops_case([1, 1, 1, 1], seed=21)
    conv_ref, rec_ref, before = conv_pool.clone(), rec_pool.float(), rec_pool.clone()
    ref = cpu_ops.gdn_decode(proj, conv_w, conv_ref, rec_ref, slots, *rest)
    got = cpu_ops.gdn_decode(proj, conv_w, conv_pool, rec_pool, slots, *rest)
    assert torch.equal(got, ref)  # the same float32 arithmetic from the same (widened) state
    _check_pools("gdn_decode", conv_pool, rec_pool, conv_ref, rec_ref, slots, before)


def test_cpu_gdn_rows_on_a_bf16_pool_matches_the_chunked_path():
    """Rows of any length in C on a bfloat16 state against the PyTorch chunked prefill on the same
    bfloat16 pool (itself pinned to the naive loop above)."""
    from kernels import cpu_ops
    from tests.kernels.test_cpu_ops import _eager_gdn_rows

    if not cpu_ops.available():
        pytest.skip(cpu_ops.status())
    lens, init = [1, 40, 5, 64], torch.tensor([True, False, True, True])
    proj, conv_w, conv_pool, rec_pool, slots, rest = _cpu_ops_case(lens, seed=22)
    conv_ref, rec_ref, before = conv_pool.clone(), rec_pool.clone(), rec_pool.clone()
    ref = _eager_gdn_rows(proj, lens, slots, init, conv_w, conv_ref, rec_ref, *rest)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    tok_slots = torch.repeat_interleave(slots, torch.tensor(lens))
    got = cpu_ops.gdn_rows(proj, cu, slots, init, tok_slots, conv_w, conv_pool, rec_pool, *rest)
    assert_close("gdn_rows out", got, ref, O_TOL)
    _check_pools("gdn_rows", conv_pool, rec_pool, conv_ref, rec_ref.float(), slots, before)

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

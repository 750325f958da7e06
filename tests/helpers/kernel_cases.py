"""Case builders shared by the conv and GDN kernel tests (tests/kernels/test_conv.py,
test_gdn.py) and the model-size tests (test_model_shapes.py): packed rows, a state pool with
slots outside the batch, NaN in every slot a row without initial state must not read."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from kernels.gdn import l2norm
from tests.helpers.kernel_testing import assert_close, assert_unchanged, cu_seqlens, pick_slots

LENGTHS = [1, 7, 63, 64, 65, 130]
DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.bfloat16, id="bf16")]
KC = 4  # conv kernel width
STATE_TOL = 1e-4  # GDN states are float32 whatever the activations' dtype


def state_pool(slot_shape, batch: int, extra_slots: int, gen: torch.Generator, has_init, dtype=torch.float32):
    """(pool [batch + extra_slots, *slot_shape], slots [batch], others, has_init [batch]): the
    rows' slots picked at random, `has_init` by default a mix (first row with state); the slots
    of rows without initial state are NaN."""
    pool = torch.randn(batch + extra_slots, *slot_shape, generator=gen).to(dtype)
    slots, others = pick_slots(batch + extra_slots, batch, gen)
    has_init = torch.arange(batch) % 3 != 1 if has_init is None else torch.as_tensor(has_init, dtype=torch.bool)
    pool[slots[~has_init]] = float("nan")
    return pool, slots, others, has_init


def conv_case(lens, D, dtype, seed=0, extra_slots=3, has_init=None):
    """x [T, D], weight [D, Kc], cu_seqlens, the conv state pool [S, D, Kc - 1], slots, slots
    outside the batch, has_init."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lens), D, generator=gen).to(dtype)
    w = (torch.randn(D, KC, generator=gen) * 0.5).to(dtype)
    pool, slots, others, has_init = state_pool((D, KC - 1), len(lens), extra_slots, gen, has_init, dtype)
    return x, w, cu_seqlens(lens), pool, slots, others, has_init


@dataclass
class GDNCase:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    cu: torch.Tensor
    pool: torch.Tensor
    slots: torch.Tensor
    others: torch.Tensor
    has_init: torch.Tensor

    def args(self, device="cpu"):
        """q, k, v, g, beta, cu_seqlens on `device`."""
        return tuple(x.to(device) for x in (self.q, self.k, self.v, self.g, self.beta, self.cu))


def gdn_case(lens, heads, dtype, seed=0, extra_slots=3, has_init=None) -> GDNCase:
    """Packed rows of the given lengths for heads (Hk, Hv, dk, dv); a float32 recurrent-state pool
    with `extra_slots` slots not in the batch."""
    gen = torch.Generator().manual_seed(seed)
    hk, hv, dk, dv = heads
    T = sum(lens)
    q = l2norm(torch.randn(T, hk, dk, generator=gen)).to(dtype)
    k = l2norm(torch.randn(T, hk, dk, generator=gen)).to(dtype)
    v = torch.randn(T, hv, dv, generator=gen).to(dtype)
    g = -F.softplus(torch.randn(T, hv, generator=gen) - 1.0)  # float32 log decay < 0
    beta = torch.sigmoid(torch.randn(T, hv, generator=gen))
    pool, slots, others, has_init = state_pool((hv, dk, dv), len(lens), extra_slots, gen, has_init)
    return GDNCase(q, k, v, g, beta, cu_seqlens(lens), pool, slots, others, has_init)


def check_pool(name, pool_got, pool_ref, pool_before, case):
    """The batch's slots hold the reference's final states; every other slot is untouched."""
    assert_close(f"{name} final state", pool_got.cpu()[case.slots], pool_ref[case.slots], STATE_TOL)
    assert_unchanged(f"{name}: slots not in the batch", pool_got.cpu()[case.others], pool_before[case.others])

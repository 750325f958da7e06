"""State points (kernels/points.py): the GDN recurrent state and the conv state after positions
inside the sequences of one prefill call, from the PyTorch path and the Triton kernel, against
the naive per-token loops run on each sequence's prefix."""

from __future__ import annotations

import pytest
import torch

from kernels.conv import causal_conv1d
from kernels.gdn import gdn_chunk_prefill, l2norm
from kernels.naive import naive_conv, naive_gdn
from kernels.points import StatePoints
from tests.helpers.kernel_testing import DEVICE, cu_seqlens, to_dev

LENS = [70, 5, 130]  # chunk-crossing, shorter than the conv window's history, several chunks
# (sequence, offset, dest): first token, chunk ends and starts, mid-chunk, a sequence's end
POINTS = [(0, 1, 0), (0, 32, 1), (0, 33, 2), (0, 70, 3), (1, 2, 4), (2, 64, 5), (2, 100, 6), (2, 130, 7)]
HK, HV, DK, DV, D, KC = 2, 4, 16, 8, 12, 4


def _gdn_case():
    gen = torch.Generator().manual_seed(3)
    T = sum(LENS)
    q = l2norm(torch.randn(T, HK, DK, generator=gen))
    k = l2norm(torch.randn(T, HK, DK, generator=gen))
    v = torch.randn(T, HV, DV, generator=gen)
    g = -0.5 * torch.rand(T, HV, generator=gen)
    beta = torch.rand(T, HV, generator=gen)
    pool = torch.randn(4, HV, DK, DV, generator=gen)
    return q, k, v, g, beta, pool


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_gdn_states_at_points_match_the_naive_loop(path):
    q, k, v, g, beta, pool = _gdn_case()
    cu, slots, init = cu_seqlens(LENS), torch.tensor([2, 0, 3]), torch.tensor([True, False, True])
    before = pool.clone()
    snaps = torch.full((8, HV, DK, DV), float("nan"))
    if path == "torch":
        out = gdn_chunk_prefill(
            q, k, v, g, beta, cu, pool, slots, init, points=StatePoints.build(3, POINTS), points_pool=snaps
        )
        plain = gdn_chunk_prefill(q, k, v, g, beta, cu, before.clone(), slots, init)
    else:
        from kernels.triton.gdn_chunk import gdn_chunk_prefill_triton

        args = to_dev(q, k, v, g, beta, cu, pool, slots, init)
        dsnaps = snaps.to(DEVICE)
        out = gdn_chunk_prefill_triton(
            *args, None, 16, points=StatePoints.build(3, POINTS, DEVICE), points_pool=dsnaps
        ).cpu()
        plain = gdn_chunk_prefill_triton(*to_dev(q, k, v, g, beta, cu, before.clone(), slots, init), None, 16).cpu()
        snaps = dsnaps.cpu()
    torch.testing.assert_close(out, plain)  # points change nothing else
    starts = cu.tolist()
    for b, off, d in POINTS:
        s = starts[b]
        _, ref = naive_gdn(*(x[s : s + off] for x in (q, k, v, g, beta)), before[slots[b]] if init[b] else None)
        torch.testing.assert_close(snaps[d], ref, rtol=1e-4, atol=1e-4, msg=f"sequence {b} after {off}")


def test_conv_states_at_points_match_the_naive_loop():
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(sum(LENS), D, generator=gen), torch.randn(D, KC, generator=gen)
    pool = torch.randn(4, D, KC - 1, generator=gen)
    cu, slots, init = cu_seqlens(LENS), torch.tensor([2, 0, 3]), torch.tensor([True, False, True])
    before = pool.clone()
    snaps = torch.full((8, D, KC - 1), float("nan"))
    causal_conv1d(x, w, cu, pool, slots, init, points=StatePoints.build(3, POINTS), points_pool=snaps)
    starts = cu.tolist()
    for b, off, d in POINTS:
        _, ref = naive_conv(x[starts[b] : starts[b] + off], w, before[slots[b]] if init[b] else None)
        torch.testing.assert_close(snaps[d], ref, msg=f"sequence {b} after {off}")


def test_points_outside_a_sequence_are_refused():
    q, k, v, g, beta, pool = _gdn_case()
    cu, slots = cu_seqlens(LENS), torch.tensor([2, 0, 3])
    with pytest.raises(ValueError, match="offsets must be in 1..their sequence's length"):
        points = StatePoints.build(3, [(1, 6, 0)])
        gdn_chunk_prefill(q, k, v, g, beta, cu, pool, slots, points=points, points_pool=torch.zeros(1, HV, DK, DV))

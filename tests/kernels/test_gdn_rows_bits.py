"""cpu_ops.gdn_rows against cpu_ops.gdn_decode run token by token: the same bits, outputs and
states, in float32 and bfloat16. The engine relies on it: a prompt computed as rows and the same
tokens decoded one by one (a resumed or migrated request, --batch-invariant) must agree exactly.
The shapes cover the (row, key head) units in blocks of tokens (rows longer than a block, one long
row alone, one and two value heads per key head, dv 64 and 128) and the row-at-a-time path for
head sizes that are not multiples of 8."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_ops


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x.view(torch.int32)


SHAPES = {
    "grp2-dv64": (4, 8, 64, 64),
    "grp1-dv128": (2, 2, 32, 128),
    "grp2-dv32": (2, 4, 32, 32),
    "row-at-a-time": (2, 4, 12, 20),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize(
    "lens,init", [([1, 45, 70, 3], [True, False, True, False]), ([100], [False])], ids=["mixed", "one"]
)
def test_gdn_rows_equals_decode_token_by_token(dtype, shape, lens, init):
    assert cpu_ops.available(dtype), f"the CPU operators are not active: {cpu_ops.status()}"
    hk, hv, dk, dv = SHAPES[shape]
    g = torch.Generator().manual_seed(11)
    kc, S = 4, 6
    D, T, R = 2 * hk * dk + hv * dv, sum(lens), len(lens)
    proj = torch.randn(T, D + hv * dv + 2 * hv, generator=g).to(dtype)
    conv_w = (torch.randn(D, kc, generator=g) * 0.5).to(dtype)
    conv_pool = torch.randn(S, D, kc - 1, generator=g).to(dtype)
    rec_pool = torch.randn(S, hv, dk, dv, generator=g) * 0.1
    slots = torch.tensor([4, 1, 5, 0][:R])
    neg_A = -torch.rand(hv, generator=g) * 2
    dt_bias = torch.randn(hv, generator=g)
    norm_w = (1 + 0.1 * torch.randn(dv, generator=g)).to(dtype)
    rest = (neg_A, dt_bias, norm_w, hk, hv, dk, dv, 1e-6)

    conv_ref, rec_ref = conv_pool.clone(), rec_pool.clone()
    ref = torch.empty(T, hv * dv, dtype=dtype)
    t = 0
    for r, n in enumerate(lens):  # each token alone through the decode op, in order
        s = slots[r : r + 1]
        if not init[r]:
            conv_ref[s] = 0
            rec_ref[s] = 0
        for i in range(t, t + n):
            ref[i] = cpu_ops.gdn_decode(proj[i : i + 1], conv_w, conv_ref, rec_ref, s, *rest)[0]
        t += n

    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    tok_slots = torch.repeat_interleave(slots, torch.tensor(lens))
    got = cpu_ops.gdn_rows(proj, cu, slots, torch.tensor(init), tok_slots, conv_w, conv_pool, rec_pool, *rest)
    assert torch.equal(_bits(got), _bits(ref)), "gdn_rows' outputs differ from gdn_decode's"
    assert torch.equal(_bits(conv_pool[slots]), _bits(conv_ref[slots])), "conv states differ"
    assert torch.equal(_bits(rec_pool[slots]), _bits(rec_ref[slots])), "recurrent states differ"
    untouched = [i for i in range(S) if i not in slots.tolist()]
    assert torch.equal(rec_pool[untouched], rec_ref[untouched]), "a slot outside the rows was written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_gdn_rows_points_keeps_the_states_of_rows_cut_there(dtype):
    """gdn_rows_points against gdn_rows run piece by piece, cut at the points: the same outputs and
    end states, and each snapshot entry holds the state the piece ending there left in the slot
    (points at a row's start, inside its first block, on block edges, twice at one offset, at its
    end; a row without points)."""
    hk, hv, dk, dv = 2, 4, 32, 32
    g = torch.Generator().manual_seed(12)
    kc, S, E = 4, 5, 12
    D = 2 * hk * dk + hv * dv
    lens, init = [1, 70, 33, 40], [True, False, True, True]
    points = {1: [(0, 3), (5, 7), (32, 2), (64, 9), (64, 10), (70, 0)], 2: [(33, 4)], 3: [(17, 11)]}
    T = sum(lens)
    proj = torch.randn(T, D + hv * dv + 2 * hv, generator=g).to(dtype)
    conv_w = (torch.randn(D, kc, generator=g) * 0.5).to(dtype)
    conv_pool = torch.randn(S, D, kc - 1, generator=g).to(dtype)
    rec_pool = torch.randn(S, hv, dk, dv, generator=g) * 0.1
    slots = torch.tensor([3, 0, 4, 1])
    consts = (-torch.rand(hv, generator=g) * 2, torch.randn(hv, generator=g), torch.ones(dv, dtype=dtype))
    consts = (*consts, hk, hv, dk, dv, 1e-6)
    snap_conv = torch.zeros(E, D, kc - 1, dtype=dtype)
    snap_rec = torch.zeros(E, hv, dk, dv)

    conv_ref, rec_ref, snap_conv_ref, snap_rec_ref = (
        conv_pool.clone(),
        rec_pool.clone(),
        snap_conv.clone(),
        snap_rec.clone(),
    )
    ref = torch.empty(T, hv * dv, dtype=dtype)
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    for r, n in enumerate(lens):  # each row alone, in pieces ending at its points
        s, done = slots[r : r + 1], 0
        for end, dest in [*points.get(r, []), (n, None)]:
            if end > done:
                a, b = starts[r] + done, starts[r] + end
                piece = (torch.tensor([0, end - done]), s, torch.tensor([init[r] or done > 0]), s.repeat(end - done))
                ref[a:b] = cpu_ops.gdn_rows(proj[a:b], *piece, conv_w, conv_ref, rec_ref, *consts)
            elif not (init[r] or done):
                conv_ref[s], rec_ref[s] = 0, 0  # a fresh row's state at its start
            if dest is not None:
                snap_conv_ref[dest], snap_rec_ref[dest] = conv_ref[s[0]], rec_ref[s[0]]
            done = end

    flat = [(r, o, d) for r, ps in points.items() for o, d in ps]
    ptr = torch.tensor([sum(1 for r2, _, _ in flat if r2 < r) for r in range(len(lens) + 1)])
    pts = (ptr, torch.tensor([o for _, o, _ in flat]), torch.tensor([d for _, _, d in flat]))
    rows = (torch.tensor(starts), slots, torch.tensor(init), torch.repeat_interleave(slots, torch.tensor(lens)))
    got = cpu_ops.gdn_rows_points(proj, rows, conv_w, conv_pool, rec_pool, consts, pts, snap_conv, snap_rec)
    assert torch.equal(_bits(got), _bits(ref)), "outputs differ from the pieces'"
    assert torch.equal(_bits(conv_pool), _bits(conv_ref)) and torch.equal(rec_pool, rec_ref), "end states differ"
    assert torch.equal(_bits(snap_conv), _bits(snap_conv_ref)), "snapshot conv states differ"
    assert torch.equal(snap_rec, snap_rec_ref), "snapshot recurrent states differ"


def test_gdn_rows_points_refuses_bad_points():
    hk, hv, dk, dv, kc = 1, 1, 8, 8, 4
    D = 2 * hk * dk + hv * dv
    proj = torch.zeros(5, D + hv * dv + 2 * hv)
    rows = (torch.tensor([0, 5]), torch.tensor([0]), torch.tensor([False]), torch.zeros(5, dtype=torch.long))
    args = (proj, rows, torch.zeros(D, kc), torch.zeros(1, D, kc - 1), torch.zeros(1, hv, dk, dv))
    consts = (torch.zeros(hv), torch.zeros(hv), torch.ones(dv), hk, hv, dk, dv, 1e-6)
    snaps = (torch.zeros(2, D, kc - 1), torch.zeros(2, hv, dk, dv))
    with pytest.raises(RuntimeError, match="pt_off"):  # past the row's 5 tokens
        cpu_ops.gdn_rows_points(*args, consts, (torch.tensor([0, 1]), torch.tensor([6]), torch.tensor([0])), *snaps)
    with pytest.raises(RuntimeError, match="pt_dest"):  # no such snapshot entry
        cpu_ops.gdn_rows_points(*args, consts, (torch.tensor([0, 1]), torch.tensor([2]), torch.tensor([2])), *snaps)
    with pytest.raises(RuntimeError, match="ascend"):
        cpu_ops.gdn_rows_points(
            *args, consts, (torch.tensor([0, 2]), torch.tensor([3, 1]), torch.tensor([0, 1])), *snaps
        )

"""Batch-invariant mode on CUDA computes a prompt's tokens as decode steps would (docs/engine.md,
"Batch-invariant mode"): attention with every token a one-token row of the paged kernel over its
own context, and the GDN prefill through the recurrent kernel, in phases cut at prefix snapshots.
Each token's bits here equal those of the decode step that computes it alone (Triton under the
interpreter on tiny shapes, compiled on a GPU), and the values the prefill kernels'."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.model.batch import RowGroup
from engine.model.layers import GatedDeltaNet
from kernels.attention import paged_attention
from kernels.points import StatePoints
from kernels.triton.gdn_recurrent import gdn_recurrent_triton
from kernels.triton.paged_attention import paged_attention_triton
from tests.helpers.kernel_testing import TOL, assert_close, assert_unchanged, to_dev


def _i64(xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def test_prompt_tokens_as_one_token_rows_attend_as_decode_steps():
    g = torch.Generator().manual_seed(11)
    H, KVH, hd, bs, T, ctx = 4, 2, 16, 4, 6, 13  # the chunk's tokens at positions 7..12
    pool = torch.randn(8, 2, KVH, bs, hd, generator=g).bfloat16()
    table = torch.randperm(8, generator=g)[:4].view(1, 4)
    q = torch.randn(T, H, hd, generator=g).bfloat16()
    lens = torch.arange(ctx - T + 1, ctx + 1)
    scale = hd**-0.5
    pool, table, q, lens = to_dev(pool, table, q, lens)
    rows = paged_attention_triton(q, pool, to_dev(_i64(range(T + 1)))[0], lens, table.repeat(T, 1), scale, max_len=1)
    other = torch.roll(table, 1, 1)  # another sequence's pages, decoding in the same step
    for i in range(T):
        step = paged_attention_triton(
            torch.stack([q[(i + 1) % T], q[i]]),
            pool,
            to_dev(_i64([0, 1, 2]))[0],
            torch.stack([lens[-1], lens[i]]),
            torch.cat([other, table]),
            scale,
            max_len=1,
        )
        assert_unchanged(f"token {i}", rows[i], step[1])
    chunk = paged_attention(q.cpu(), pool.cpu(), _i64([0, T]), _i64([ctx]), table.cpu(), scale)
    assert_close("o", rows, chunk, TOL[torch.bfloat16])


def test_recurrent_prefill_in_phases_is_the_decode_steps_bits(monkeypatch):
    """GatedDeltaNet._recurrent_prefill over two rows (one continuing its slot, one starting),
    with prefix snapshots inside both: outputs, final states and snapshots equal a decode step per
    token, each row alone."""
    monkeypatch.setenv("PDSERVE_FORCE_TRITON", "1")  # gdn_recurrent -> the Triton kernel on any device
    g = torch.Generator().manual_seed(12)
    hk, hv, dk, dv, lens = 1, 2, 16, 16, (5, 7)
    T = sum(lens)
    q = torch.nn.functional.normalize(torch.randn(T, hk, dk, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(T, hk, dk, generator=g), dim=-1)
    v = torch.randn(T, hv, dv, generator=g).bfloat16()
    gate = -torch.rand(T, hv, generator=g)
    beta = torch.rand(T, hv, generator=g)
    pool = torch.randn(4, hv, dk, dv, generator=g)
    slots, init = [2, 0], [True, False]
    points = [(0, 2, 1), (1, 3, 0), (1, 7, 2)]  # (row, offset, snapshot entry)
    q, k, v, gate, beta, pool = to_dev(q, k, v, gate, beta, pool)
    dev = q.device

    ref_pool, want_snaps, want_o = pool.clone(), torch.zeros(3, hv, dk, dv, device=dev), []
    ref_pool[slots[1]] = 0.0  # a row that starts its sequence starts from a zero state
    for b, start in enumerate((0, lens[0])):
        for t in range(start, start + lens[b]):
            one = (x[t : t + 1] for x in (q, k, v, gate, beta))
            cu1, slot = _i64([0, 1]).to(dev), _i64([slots[b]]).to(dev)
            want_o.append(gdn_recurrent_triton(*one, cu1, ref_pool, slot, scale=1.0, max_len=1))
            for row, off, entry in points:
                if row == b and off == t - start + 1:
                    want_snaps[entry] = ref_pool[slots[b]]

    grp = RowGroup(
        tok_start=0,
        tok_end=T,
        cu_seqlens=_i64([0, lens[0], T]).to(dev),
        slot_ids=_i64(slots).to(dev),
        has_initial_state=torch.tensor(init, device=dev),
        seq_lens=_i64(lens).to(dev),
        block_tables=_i64([[0], [0]]).to(dev),
        max_row_tokens=max(lens),
        points=StatePoints.build(2, points, dev),
    )
    snaps = torch.full((3, hv, dk, dv), float("nan"), device=dev)
    pools = SimpleNamespace(recurrent={0: pool}, snapshots=SimpleNamespace(recurrent={0: snaps}))
    layer = GatedDeltaNet.__new__(GatedDeltaNet)
    layer.layer = 0
    o = layer._recurrent_prefill(pools, grp, q, k, v, gate, beta)
    assert len(grp.point_phases()) == 3
    assert_unchanged("o", o, torch.cat(want_o))
    assert_unchanged("final states", pool, ref_pool)
    assert_unchanged("snapshots", snaps, want_snaps)

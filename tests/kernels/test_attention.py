"""KV store and paged attention: Triton vs the PyTorch reference over prefill, chunked prefill
(earlier pages read back), decode and mixed speculative batches, with GQA; pages and page tails
the batch does not own are NaN, so reading them fails the test. The pools under test are views
of head-major storage, as the engine allocates them, and the references get contiguous pools in
the view's order, so every comparison also checks that the layout does not change a value."""

from __future__ import annotations

import pytest
import torch

from kernels.attention import paged_attention, store_kv
from tests.helpers.kernel_testing import (
    DEVICE,
    TOL,
    assert_close,
    assert_unchanged,
    cu_seqlens,
    head_major,
    nan_like,
    to_dev,
)

LENGTHS = [1, 7, 63, 64, 65, 130]
DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.bfloat16, id="bf16")]
# (H, KVH): GQA and plain multi-head.
HEADS = [pytest.param((4, 2), id="gqa-h4-kvh2"), pytest.param((2, 2), id="mha-h2")]
HD = 32
LAYOUTS = [pytest.param(head_major, id="head-major"), pytest.param(lambda p: p, id="block-major")]
# Rows as (new tokens, tokens in context including them).
BATCHES = [pytest.param([(n, n)], id=f"prefill-len{n}") for n in LENGTHS] + [
    pytest.param([(64, 130), (7, 70), (65, 65)], id="chunked-prefill"),
    pytest.param([(1, 1), (1, 17), (1, 130), (1, 64)], id="decode"),
    pytest.param([(1, 30), (4, 33), (1, 5), (4, 4), (4, 100)], id="mixed-decode-and-spec-k3"),
    pytest.param([(130, 130), (1, 40), (4, 70), (20, 85)], id="mixed-prefill-decode-spec"),
]


def make_case(rows, heads, dtype, block_size=16, seed=0, spare_pages=3, hd=HD, layout=head_major):
    """Pages for each row in random order; page 0 is an all-zero page that pads the block
    tables. For the Triton run every unowned page and every page tail past seq_len is NaN (pool
    in `layout`); the reference (whose masked softmax would turn a NaN value into a NaN output)
    gets zeros there, in a contiguous pool."""
    gen = torch.Generator().manual_seed(seed)
    H, kvh = heads
    n_pages = [-(-ctx // block_size) for _, ctx in rows]
    num_blocks = 1 + sum(n_pages) + spare_pages
    pool = torch.randn(num_blocks, 2, kvh, block_size, hd, generator=gen).to(dtype)
    pool[0] = 0
    order = 1 + torch.randperm(num_blocks - 1, generator=gen)
    tables = torch.zeros(len(rows), max(n_pages), dtype=torch.int32)
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    used[0] = True
    i = 0
    for b, ((_, ctx), n) in enumerate(zip(rows, n_pages)):
        tables[b, :n] = order[i : i + n].int()
        for j in range(n):
            used[order[i + j], : max(0, min(block_size, ctx - j * block_size))] = True
        i += n
    poisoned = pool.clone()
    poisoned.masked_fill_(~used[:, None, None, :, None], float("nan"))
    ref_pool = poisoned.nan_to_num(0.0).contiguous()
    poisoned = layout(poisoned)
    q = torch.randn(sum(n for n, _ in rows), H, hd, generator=gen).to(dtype)
    cu = cu_seqlens([n for n, _ in rows])
    seq_lens = torch.tensor([ctx for _, ctx in rows], dtype=torch.int64)
    return q, poisoned, ref_pool, cu, seq_lens, tables


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("rows", BATCHES)
def test_paged_attention_triton_matches_reference(rows, heads, dtype):
    from kernels.triton.paged_attention import paged_attention_triton

    q, pool, ref_pool, cu, seq_lens, tables = make_case(rows, heads, dtype)
    scale = HD**-0.5
    o_ref = paged_attention(q, ref_pool, cu, seq_lens, tables, scale)
    out = nan_like(o_ref).to(DEVICE)
    o = paged_attention_triton(*to_dev(q, pool, cu, seq_lens, tables), scale, out=out)
    assert o is out
    assert_close("o", o, o_ref, TOL[dtype])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("heads", [(4, 1), (4, 2), (6, 2)], ids=["kvh1", "kvh2", "group3"])
@pytest.mark.parametrize("block_size", [8, 12, 32], ids=lambda n: f"block{n}")
def test_paged_attention_triton_other_block_sizes(block_size, heads, layout):
    from kernels.triton.paged_attention import paged_attention_triton

    rows = [(40, 100), (1, 33), (4, 9)]
    q, pool, ref_pool, cu, seq_lens, tables = make_case(
        rows, heads, torch.float32, block_size=block_size, seed=1, layout=layout
    )
    o_ref = paged_attention(q, ref_pool, cu, seq_lens, tables, 0.3)
    o = paged_attention_triton(*to_dev(q, pool, cu, seq_lens, tables), 0.3)
    assert_close("o", o, o_ref, TOL[torch.float32])


@pytest.mark.parametrize(
    "dtypes",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
    ids=["f32", "bf16", "f32-into-bf16"],
)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_store_kv_triton_matches_reference(dtypes, layout):
    from kernels.triton.paged_attention import store_kv_triton

    src, dst = dtypes
    gen = torch.Generator().manual_seed(2)
    num_blocks, kvh, bs, T = 6, 2, 16, 37
    pool0 = torch.full((num_blocks, 2, kvh, bs, HD), float("nan"), dtype=dst)
    k = torch.randn(T, kvh, HD, generator=gen).to(src)
    v = torch.randn(T, kvh, HD, generator=gen).to(src)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:T]
    ref = pool0.clone()
    store_kv(k, v, ref, slots)
    pool = layout(pool0.clone()).to(DEVICE)
    store_kv_triton(*to_dev(k, v), pool, slots.to(DEVICE))
    pool = pool.cpu()
    written = torch.zeros(num_blocks * bs, dtype=torch.bool)
    written[slots] = True
    written = written.view(num_blocks, 1, 1, bs, 1).expand_as(pool)
    assert_unchanged("pool positions not in slot_mapping", pool[~written], pool0[~written])
    if src == dst:
        assert_unchanged("stored K/V", pool[written], ref[written])
    else:
        assert_close("stored K/V", pool[written], ref[written], TOL[dst])


def test_store_then_attend_matches_reference():
    """Chunked prefill as the engine runs it: store a chunk's K/V into the pages, then attend."""
    from kernels.triton.paged_attention import paged_attention_triton, store_kv_triton

    rows = [(20, 50), (1, 17), (4, 36)]
    q, pool, ref_pool, cu, seq_lens, tables = make_case(rows, (4, 2), torch.float32, seed=3)
    gen = torch.Generator().manual_seed(4)
    pos = torch.cat([torch.arange(ctx - n, ctx) for n, ctx in rows])
    row = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([n for n, _ in rows]))
    slot_mapping = tables[row, pos // 16].long() * 16 + pos % 16
    k_new = torch.randn(len(pos), 2, HD, generator=gen)
    v_new = torch.randn(len(pos), 2, HD, generator=gen)
    store_kv(k_new, v_new, ref_pool, slot_mapping)
    o_ref = paged_attention(q, ref_pool, cu, seq_lens, tables, 0.2)
    pool = pool.to(DEVICE)
    store_kv_triton(*to_dev(k_new, v_new), pool, slot_mapping.to(DEVICE))
    o = paged_attention_triton(*to_dev(q), pool, *to_dev(cu, seq_lens, tables), 0.2)
    assert_close("o", o, o_ref, TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_layout_independent(dtype):
    """The PyTorch path (the engine's CPU path) writes and reads a head-major pool view exactly
    as a contiguous pool: same bytes stored, bit-identical attention output."""
    rows = [(20, 50), (1, 17), (4, 36)]
    q, _, flat, cu, seq_lens, tables = make_case(rows, (4, 2), dtype, seed=6)
    hm = head_major(flat)
    assert hm.permute(2, 0, 1, 3, 4).is_contiguous() and not hm.is_contiguous()
    gen = torch.Generator().manual_seed(7)
    pos = torch.cat([torch.arange(ctx - n, ctx) for n, ctx in rows])
    row = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([n for n, _ in rows]))
    slot_mapping = tables[row, pos // 16].long() * 16 + pos % 16
    k_new, v_new = torch.randn(2, len(pos), 2, HD, generator=gen)
    for pool in (flat, hm):
        store_kv(k_new, v_new, pool, slot_mapping)
    assert_unchanged("stored pool", hm, flat)
    o_flat = paged_attention(q, flat, cu, seq_lens, tables, 0.2)
    assert_unchanged("o", paged_attention(q, hm, cu, seq_lens, tables, 0.2), o_flat)


def test_attention_wrappers_reject_bad_arguments():
    from kernels.triton.paged_attention import paged_attention_triton, store_kv_triton

    q, pool, _, cu, seq_lens, tables = make_case([(3, 20), (1, 5)], (4, 2), torch.float32)
    with pytest.raises(
        ValueError, match=r"kv_pool must be \[num_blocks, 2, KVH, block_size, hd\].*kv_pool=\(7, 2, 2, 32, 16\)"
    ):
        paged_attention_triton(q, pool.transpose(-1, -2).contiguous(), cu, seq_lens, tables, 1.0)
    with pytest.raises(ValueError, match=r"query heads must be a multiple of KV heads.*q=\(4, 3, 32\)"):
        paged_attention_triton(q[:, :3].contiguous(), pool, cu, seq_lens, tables, 1.0)
    with pytest.raises(ValueError, match=r"block_tables must be int32/int64.*\(2, 2\):torch.float32"):
        paged_attention_triton(q, pool, cu, seq_lens, tables.float(), 1.0)
    with pytest.raises(ValueError, match=r"slot_mapping must be \[T=4\] \(got \(3,\)\)"):
        store_kv_triton(torch.zeros(4, 2, HD), torch.zeros(4, 2, HD), pool, torch.zeros(3, dtype=torch.int64))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_triton_large(dtype):
    from kernels.triton.paged_attention import paged_attention_triton

    rows = [(300, 300), (1, 1000), (4, 517), (128, 640)]
    q, pool, ref_pool, cu, seq_lens, tables = make_case(rows, (16, 2), dtype, seed=5, hd=128)
    o_ref = paged_attention(q, ref_pool, cu, seq_lens, tables, 128**-0.5)
    o = paged_attention_triton(*to_dev(q, pool, cu, seq_lens, tables), 128**-0.5)
    assert_close("o", o, o_ref, TOL[dtype])


@pytest.mark.parametrize("lens", [[16, 16, 16], [5, 33, 1]], ids=["one-length", "varlen"])
def test_causal_attention_matches_naive_softmax(lens):
    """Fresh prompts attend over their own k, v (no pages): a per-token float64 softmax loop."""
    from kernels.attention import causal_attention

    gen = torch.Generator().manual_seed(5)
    T, H, kvh = sum(lens), 4, 2
    q, k, v = (torch.randn(T, n, HD, generator=gen) for n in (H, kvh, kvh))
    got = causal_attention(q, k, v, cu_seqlens(lens), 0.2)
    ref = torch.empty(T, H, HD, dtype=torch.float64)
    start = 0
    for n in lens:
        for t in range(start, start + n):
            for h in range(H):
                s = (k[start : t + 1, h // 2].double() @ q[t, h].double()) * 0.2
                ref[t, h] = torch.softmax(s, 0) @ v[start : t + 1, h // 2].double()
        start += n
    assert_close("o", got, ref.float(), 1e-5)


def test_pages_past_every_rows_context_are_not_read():
    """A long prompt's table holds all its pages from its first chunk on: the PyTorch path attends
    over the pages the batch's longest row has filled (NaN in the later ones would poison the
    output were they read), against a per-token float64 softmax loop over each row's context."""
    gen = torch.Generator().manual_seed(6)
    bs, H, kvh, rows = 16, 4, 2, [(20, 50), (4, 36)]  # (new tokens, context so far)
    n_pages = 8  # each row owns 8 pages (128 tokens), fewer than 4 of them filled
    pool = torch.randn(1 + len(rows) * n_pages, 2, kvh, bs, HD, generator=gen)
    tables = (1 + torch.arange(len(rows) * n_pages)).view(len(rows), n_pages).int()
    longest = -(-max(ctx for _, ctx in rows) // bs)
    pool[tables[:, longest:].reshape(-1).long()] = float("nan")  # past every row's context: not yet written
    q = torch.randn(sum(n for n, _ in rows), H, HD, generator=gen)
    seq_lens = torch.tensor([ctx for _, ctx in rows])
    got = paged_attention(q, pool, cu_seqlens([n for n, _ in rows]), seq_lens, tables, 0.2)
    ref, t0 = torch.empty_like(got, dtype=torch.float64), 0
    for b, (n, ctx) in enumerate(rows):
        kv = pool[tables[b].long()].permute(1, 2, 0, 3, 4).reshape(2, kvh, -1, HD)[:, :, :ctx].double()
        for i in range(n):
            see = ctx - n + i + 1
            for h in range(H):
                s = (kv[0, h // 2, :see] @ q[t0 + i, h].double()) * 0.2
                ref[t0 + i, h] = torch.softmax(s, 0) @ kv[1, h // 2, :see]
        t0 += n
    assert not got.isnan().any()
    assert_close("o", got, ref.float(), 1e-5)

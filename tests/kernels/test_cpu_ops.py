"""The fused CPU operators of the decode step (torch.ops.pdserve.*, kernels/cpu_ops.py) against
the PyTorch ops they replace: float32 to float32 rounding, bfloat16 to a few bfloat16 ulps.
`make test` builds them first (python -m kernels.build); test_built fails when they are not
active, with the loader's reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.cache.allocator import kv_pool_view
from engine.model.rotary import apply_rotary_
from kernels import (
    causal_conv1d,
    conv_update_,
    cpu_ops,
    gated_rms_norm,
    gdn_chunk_prefill,
    gdn_decode_step_,
    l2norm,
    paged_attention,
    rms_norm,
    store_kv,
)
from tests.helpers.kernel_testing import assert_close, attn_rows_case

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def test_built():
    assert cpu_ops.available(), f"the CPU operators are not active: {cpu_ops.status()}"


def _eager_gdn(proj, conv_w, conv_pool, rec_pool, slots, neg_A, dt_bias, norm_w, hk, hv, dk, dv, eps):
    """The engine's PyTorch path for one decode token per row (engine/model/layers.py)."""
    B = proj.shape[0]
    D = conv_w.shape[0]
    qkv, z, b, a = proj.split([D, hv * dv, hv, hv], dim=-1)
    state = conv_pool[slots]
    y = conv_update_(qkv, conv_w, state)
    conv_pool[slots] = state
    qk, v = y.split([2 * hk * dk, hv * dv], dim=-1)
    qk = qk.reshape(B, 2 * hk, dk).float()
    qk = qk * torch.rsqrt((qk * qk).sum(-1, keepdim=True) + 1e-6)
    q, k = qk[:, :hk] * dk**-0.5, qk[:, hk:]
    beta = b.sigmoid().float()
    g = neg_A * F.softplus(a.float() + dt_bias)
    S = rec_pool[slots]
    o = gdn_decode_step_(q, k, v.reshape(B, hv, dv), g, beta, S, 1.0)
    rec_pool[slots] = S
    return gated_rms_norm(o, z.reshape(B, hv, dv), norm_w, eps).reshape(B, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "B,hk,hv,dk,dv",
    [(1, 2, 4, 32, 32), (5, 4, 8, 64, 64), (3, 3, 3, 16, 48), (6, 4, 24, 64, 64)],
    ids=["b1-hv2x", "b5-d64", "b3-hv1x", "b6-split"],  # b6 x 24 heads: enough work to split rows over threads
)
def test_gdn_decode_matches_pytorch(dtype, B, hk, hv, dk, dv):
    g = torch.Generator().manual_seed(0)
    D, kc, S = 2 * hk * dk + hv * dv, 4, 7
    proj = torch.randn(B, D + hv * dv + 2 * hv, generator=g).to(dtype)
    conv_w = (torch.randn(D, kc, generator=g) * 0.5).to(dtype)
    conv_pool = torch.randn(S, D, kc - 1, generator=g).to(dtype)
    rec_pool = torch.randn(S, hv, dk, dv, generator=g) * 0.1
    slots = torch.randperm(S, generator=g)[:B]
    neg_A = -torch.rand(hv, generator=g) * 2
    dt_bias = torch.randn(hv, generator=g).to(dtype).float()
    norm_w = (1 + 0.1 * torch.randn(dv, generator=g)).to(dtype)
    args = (slots, neg_A, dt_bias, norm_w, hk, hv, dk, dv, 1e-6)
    conv_ref, rec_ref = conv_pool.clone(), rec_pool.clone()
    ref = _eager_gdn(proj, conv_w, conv_ref, rec_ref, *args)
    got = cpu_ops.gdn_decode(proj, conv_w, conv_pool, rec_pool, *args)
    assert_close("gdn_decode out", got, ref, TOL[dtype])
    assert_close("conv state", conv_pool, conv_ref, TOL[dtype] / 10)
    assert_close("recurrent state", rec_pool, rec_ref, TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("with_h", [True, False], ids=["add", "norm-only"])
@pytest.mark.parametrize("T", [6, 701], ids=["rows6", "rows701-threads"])  # 701 x 96: blocks of 64 over threads
@pytest.mark.parametrize("H", [96, 100], ids=["h96", "h100-tail"])  # 100: four past the last eight lanes
def test_add_rms_norm_matches_pytorch(dtype, with_h, T, H):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(T, H, generator=g) * 3).to(dtype)
    h = torch.randn(T, H, generator=g).to(dtype) if with_h else None
    w = 1 + 0.1 * torch.randn(H, generator=g)
    xs = x + h if with_h else x
    xo, y = cpu_ops.add_rms_norm(x, h, w, 1e-6)
    assert torch.equal(xo, xs), "the residual sum is rounded once, like x + h"
    assert_close("add_rms_norm", y, rms_norm(xs, w, 1e-6, zero_centered=False), TOL[dtype] / 2)


@pytest.mark.parametrize("M", [1, 3, 4])
@pytest.mark.parametrize("threads", [1, 2])
def test_gemv_bf16_matches_float32_gemm(M, threads):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(300, 131, generator=g).bfloat16()  # K not a multiple of 8: the tail loop
    x = torch.randn(M, 131, generator=g).bfloat16()
    ref = F.linear(x.float(), w.float())
    assert_close("gemv_bf16 float32 out", cpu_ops.gemv_bf16(x, w, torch.float32, threads), ref, 1e-6)
    got = cpu_ops.gemv_bf16(x, w, torch.bfloat16, threads)
    assert (got.float() - ref.bfloat16().float()).abs().max() <= ref.abs().max() * 2**-8, "rounded to bf16 once"


def _eager_attn(qkv, qk_norm, eps, cos, sin, kv_pool, slot_mapping, block_tables, seq_lens, h, kvh, scale):
    """The engine's PyTorch path for one decode token per row (engine/model/layers.py)."""
    B, hd = qkv.shape[0], kv_pool.shape[-1]
    qk, gate, v = qkv.split([(h + kvh) * hd, h * hd, kvh * hd], dim=-1)
    qk = F.rms_norm(qk.reshape(B, h + kvh, hd).float(), (hd,), None, eps)
    qk = apply_rotary_((qk * qk_norm).to(qkv.dtype), cos, sin)
    q, k = qk[:, :h], qk[:, h:]
    store_kv(k, v.reshape(B, kvh, hd), kv_pool, slot_mapping)
    o = paged_attention(q, kv_pool, torch.arange(B + 1), seq_lens, block_tables, scale)
    return o.reshape(B, -1) * torch.sigmoid(gate)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "B,h,kvh,hd,rd,bs",
    [
        (1, 4, 2, 64, 32, 4),
        (5, 4, 2, 64, 16, 4),
        (3, 3, 3, 48, 48, 4),
        (4, 4, 2, 64, 16, 16),
        (3, 2, 1, 72, 72, 16),
        (2, 2, 1, 36, 20, 4),
    ],
    ids=["b1-gqa", "b5-partial", "b3-mha", "b4-pages16", "b3-hd72-pages16", "b2-hd36"],
)  # pages of 16: the scores 8 positions at a time; hd 72: a value tail past 64; hd 36 (rotary half 10):
# the per-row loops' one-lane tails past the last multiple of 8
def test_attn_decode_matches_pytorch(dtype, B, h, kvh, hd, rd, bs):
    g = torch.Generator().manual_seed(3)
    nblocks, width = 40, 6
    qkv = torch.randn(B, 2 * (h + kvh) * hd, generator=g).to(dtype)
    qk_norm = 1 + 0.1 * torch.randn(h + kvh, hd, generator=g)
    # head-major storage seen through the kernels' view, as the engine allocates its pools
    kv_pool = kv_pool_view(torch.randn(kvh, nblocks, 2, bs, hd, generator=g).to(dtype))
    seq_lens = torch.randint(1, width * bs + 1, (B,), generator=g)
    seq_lens[0] = width * bs  # a full last page
    block_tables = torch.randperm(nblocks, generator=g)[: B * width].view(B, width)
    pos = seq_lens - 1
    slot_mapping = block_tables[torch.arange(B), pos // bs] * bs + pos % bs
    ang = pos[:, None].float() * torch.rand(rd // 2, generator=g)[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :].to(dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :].to(dtype)
    args = (qk_norm, 1e-6, cos, sin)
    rest = (slot_mapping, block_tables, seq_lens, h, kvh, hd**-0.5)
    pool_ref = kv_pool.clone()
    ref = _eager_attn(qkv, *args, pool_ref, *rest)
    got = cpu_ops.attn_decode(qkv, *args, kv_pool, *rest)
    assert_close("attn_decode out", got, ref, TOL[dtype])
    assert_close("KV pages", kv_pool, pool_ref, TOL[dtype] / 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("nthreads", [1, 2])
@pytest.mark.parametrize("scale", [1, 40], ids=["short", "long-split"])  # long: enough work to split over threads
def test_attn_decode_rows_of_one_sequence_match_pytorch(dtype, nthreads, scale):
    """seq_starts: sequences of several consecutive tokens (rows with drafts, MTP chunks) against
    the engine's PyTorch path (causal attention within each sequence over its pages), split
    over threads by sequence."""
    g = torch.Generator().manual_seed(4)
    h, kvh, hd, rd, bs, nblocks, width = 4, 2, 32, 16, 4, 40 * scale, 6 * scale
    lens, ctx = [3, 1, 5, 2], [7 * scale, 20 * scale, 24 * scale, 2 * scale]  # new tokens per sequence; context after
    c = attn_rows_case(g, dtype, h, kvh, hd, rd, bs, lens, ctx, nblocks, width)
    qkv, qk_norm, kv_pool, tables, seq, pos = c["qkv"], c["qk_norm"], c["pool"], c["tables"], c["seq"], c["pos"]
    slot_mapping, starts, B = c["slots"], c["starts"], sum(lens)
    cos, sin = c["cos"][:, None, :], c["sin"][:, None, :]
    pool_ref = kv_pool.clone()
    qk, gate, v = qkv.split([(h + kvh) * hd, h * hd, kvh * hd], dim=-1)
    qk = F.rms_norm(qk.reshape(B, h + kvh, hd).float(), (hd,), None, 1e-6)
    qk = apply_rotary_((qk * qk_norm).to(dtype), cos, sin)
    store_kv(qk[:, h:], v.reshape(B, kvh, hd), pool_ref, slot_mapping)
    o = paged_attention(qk[:, :h], pool_ref, starts, torch.tensor(ctx), tables, hd**-0.5)
    ref = o.reshape(B, -1) * torch.sigmoid(gate)
    before = torch.get_num_threads()
    torch.set_num_threads(nthreads)
    try:
        got = cpu_ops.attn_decode(qkv, qk_norm, 1e-6, cos, sin, kv_pool, slot_mapping, tables[seq], pos + 1, h, kvh,
                                  hd**-0.5, seq_starts=starts)  # fmt: skip
    finally:
        torch.set_num_threads(before)
    assert_close("attn_decode out", got, ref, TOL[dtype])
    assert_close("KV pages", kv_pool, pool_ref, TOL[dtype] / 10)


def _eager_gdn_rows(proj, lens, slots, init, conv_w, conv_pool, rec_pool, neg_A, dt_bias, norm_w, hk, hv, dk, dv, eps):
    """The engine's chunked PyTorch path for prefill rows (engine/model/layers.py)."""
    T, D = proj.shape[0], conv_w.shape[0]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    qkv, z, b, a = proj.split([D, hv * dv, hv, hv], dim=-1)
    y = causal_conv1d(qkv, conv_w, cu, conv_pool, slots, init)
    qk, v = y.split([2 * hk * dk, hv * dv], dim=-1)
    qk = l2norm(qk.reshape(T, 2 * hk, dk))
    q, k = qk[:, :hk] * dk**-0.5, qk[:, hk:]
    g = neg_A * F.softplus(a.float() + dt_bias)
    o = gdn_chunk_prefill(q, k, v.reshape(T, hv, dv), g, b.sigmoid().float(), cu, rec_pool, slots, init, 1.0)
    return gated_rms_norm(o, z.reshape(T, hv, dv), norm_w, eps).reshape(T, -1)


@pytest.mark.parametrize(
    "lens,init", [([37], [False]), ([1, 40, 5, 64], [True, False, True, False])], ids=["one", "mixed"]
)
def test_gdn_rows_matches_chunked_prefill(lens, init):
    """Rows of any length token by token in C against the chunked prefill (float32)."""
    g = torch.Generator().manual_seed(4)
    hk, hv, dk, dv, kc, S = 2, 4, 32, 32, 4, 9
    D, T, R = 2 * hk * dk + hv * dv, sum(lens), len(lens)
    proj = torch.randn(T, D + hv * dv + 2 * hv, generator=g)
    conv_w = torch.randn(D, kc, generator=g) * 0.5
    conv_pool = torch.randn(S, D, kc - 1, generator=g)
    rec_pool = torch.randn(S, hv, dk, dv, generator=g) * 0.1
    conv_pool[0] = float("nan")  # a never-written slot: a row that starts fresh must not read it
    slots = torch.tensor([0, 3, 5, 8][:R]) if not init[0] else torch.tensor([2, 0, 5, 8][:R])
    init_t = torch.tensor(init)
    neg_A = -torch.rand(hv, generator=g) * 2
    dt_bias = torch.randn(hv, generator=g)
    norm_w = 1 + 0.1 * torch.randn(dv, generator=g)
    rest = (neg_A, dt_bias, norm_w, hk, hv, dk, dv, 1e-6)
    conv_ref, rec_ref = conv_pool.clone(), rec_pool.clone()
    ref = _eager_gdn_rows(proj, lens, slots, init_t, conv_w, conv_ref, rec_ref, *rest)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    tok_slots = torch.repeat_interleave(slots, torch.tensor(lens))
    got = cpu_ops.gdn_rows(proj, cu, slots, init_t, tok_slots, conv_w, conv_pool, rec_pool, *rest)
    assert_close("gdn_rows out", got, ref, 1e-4)
    assert_close("conv states", conv_pool[slots], conv_ref[slots], 1e-6)
    assert_close("recurrent states", rec_pool[slots], rec_ref[slots], 1e-4)


@pytest.mark.parametrize("M,I", [(3, 20), (130, 72)])
def test_silu_mul_matches_pytorch(M, I):
    """The MLP's gate in C against F.silu(gate) * up, rows read ld apart (a wider tensor's view)."""
    g = torch.Generator().manual_seed(6)
    wide = torch.randn(M, 2 * I + 5, generator=g) * 4
    gu = wide[:, : 2 * I]
    ref = F.silu(gu[:, :I]) * gu[:, I:]
    assert_close("silu_mul", cpu_ops.silu_mul(gu), ref, 1e-6)


@pytest.mark.parametrize("M,I", [(3, 20), (130, 72)])
def test_silu_mul_bfloat16_rounds_where_pytorch_does(M, I):
    """bfloat16: F.silu(gate).mul_(up) rounds the silu, then the product; the C pass does the
    same, so it is within one bfloat16 step of it (its exp is not PyTorch's) and exact on the
    float32 values it rounds."""
    g = torch.Generator().manual_seed(7)
    wide = (torch.randn(M, 2 * I + 5, generator=g) * 4).bfloat16()
    gu = wide[:, : 2 * I]
    got = cpu_ops.silu_mul(gu)
    assert got.dtype == torch.bfloat16 and got.shape == (M, I)
    ref = F.silu(gu[:, :I].clone()).mul_(gu[:, I:])
    step = ref.float().abs() * 2**-7 + 1e-30  # one bfloat16 step at each value
    assert ((got.float() - ref.float()).abs() <= step * 1.01).all()
    silu_f32 = F.silu(gu[:, :I].float()).bfloat16().float()  # rounded, then the product rounded
    assert_close("silu_mul bf16", got.float(), (silu_f32 * gu[:, I:].float()).bfloat16().float(), 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [1000, 151936])
def test_mask_logits_matches_unpacked_mask(dtype, V):
    """The grammar mask in place against the unpacked bool mask and masked_fill_ (the GPU path's
    and the fallback's), on rows a subset of x: words of all ones, all zeros and mixed, a last
    word cut by V, untouched rows left bit-identical."""
    from engine.structured.bitmask import forbidden, words

    g = torch.Generator().manual_seed(V)
    N, rows = 6, torch.tensor([4, 0, 3], dtype=torch.long)
    x = torch.randn(N, V, generator=g).to(dtype)
    W = words(V)
    bm = torch.randint(-(2**31), 2**31 - 1, (len(rows), W), generator=g, dtype=torch.int64).to(torch.int32)
    kind = torch.randint(0, 3, (len(rows), W), generator=g)
    bm[kind == 0] = -1  # every token of the word allowed
    bm[kind == 1] = 0  # none
    bm[2] = 0
    bm[2, 7] = 1 << 5  # one token allowed in the whole row
    want = x.clone()
    want[rows] = want[rows].masked_fill(forbidden(bm, V, torch.device("cpu")), float("-inf"))
    got = x.clone()
    cpu_ops.mask_logits(got, bm, rows)
    assert torch.equal(got, want)
    assert torch.isfinite(got[3]).sum() == 1 and torch.isfinite(got[3, 7 * 32 + 5])


def test_mask_logits_refuses_a_bitmask_of_the_wrong_width():
    x = torch.zeros(2, 100)
    with pytest.raises(RuntimeError, match="bitmask"):
        cpu_ops.mask_logits(x, torch.zeros(1, 3, dtype=torch.int32), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="rows"):
        cpu_ops.mask_logits(x, torch.zeros(1, 4, dtype=torch.int32), torch.tensor([2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [1000, 151936])
def test_masked_argmax_matches_mask_then_max(dtype, V):
    """Each row's first largest allowed logit against mask_logits' reference then max(-1): rows
    unconstrained (all ones), narrowed to a few tokens, half the words out, a tie (the first
    wins, as max's index), and the last word cut by V."""
    from engine.structured.bitmask import forbidden, words

    g = torch.Generator().manual_seed(V + 1)
    N, W = 5, words(V)
    x = torch.randn(N, V, generator=g).to(dtype)
    bm = torch.full((N, W), -1, dtype=torch.int32)
    bm[1] = 0
    bm[1, 3], bm[1, W - 1] = 0b1011, -1  # a few tokens, and the last (partial) word
    half = torch.randint(0, 2, (W,), generator=g).bool()
    bm[2, half] = 0
    bm[3] = torch.randint(-(2**31), 2**31 - 1, (W,), generator=g, dtype=torch.int64).to(torch.int32)
    x[4, 10] = x[4, 700] = x[4].max() + 1  # a tie: the first index
    want = x.masked_fill(forbidden(bm, V, torch.device("cpu")), float("-inf")).max(-1).indices
    got = cpu_ops.masked_argmax(x, bm)
    assert torch.equal(got, want) and got[4] == 10


@pytest.mark.parametrize("k", [1, 5, 20, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_topk_equals_the_stable_sort(k, dtype):
    """The CPU sampler's one-pass top-k against `topk_reference` (a stable sort), values and ids:
    a tie of 100 values, NaN rows (some, every 64th, all), rows of -inf, -0.0 and +0.0, +inf, a
    row of one value (every id ties), the largest values at the row's end, rows of bfloat16."""
    from engine.sampling.filters import topk_reference

    g = torch.Generator().manual_seed(k)
    v = 151_936
    x = (torch.randn(12, v, generator=g) * 3).to(dtype)
    x[0, 1000:1100] = 30.0
    x[1, [5, 7, 9000]] = float("nan")
    x[2] = float("-inf")
    x[2, [3, v - 1]] = 1.0
    x[3, -3:] = 40.0
    x[4] = float("-inf")
    x[4, 0] = -0.0
    x[5, 100] = 0.0
    x[6] = 2.0
    x[7, ::64] = float("nan")
    x[8, 77] = float("inf")
    x[9] = float("nan")
    vals, ids = cpu_ops.topk(x, k)
    rv, ri = topk_reference(x, k)
    assert vals.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, ri) and torch.equal(vals, rv)


def test_topk_refuses_a_bad_k():
    x = torch.zeros(2, 10)
    for k in (0, 11):
        with pytest.raises(RuntimeError, match="k must be in 1..10"):
            cpu_ops.topk(x, k)

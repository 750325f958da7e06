"""The compiled Triton kernels at Qwen3.5-35B-A3B's sizes against their PyTorch references on CPU
(needs a GPU; the interpreter would take hours at these sizes).

Sizes from the published config (one rank, TP 1): Gated DeltaNet with 16 key heads and 32 value
heads of 128 (conv over 2 * 16 * 128 + 32 * 128 = 8192 channels, kernel 4); full attention with
16 query heads and 2 KV heads of 256, pages of 16 tokens. Batches: a 4k-token prefill, a mix of
shorter rows (some continuing from a saved state), a chunked prefill reading 2k tokens
of earlier pages, and decode at batch 64, plain and with 3 speculative tokens per row. The case
builders are the small tests' own (tests/helpers/kernel_cases.py) (NaN in every slot and page the batch must not read)."""

from __future__ import annotations

import os

import pytest
import torch

from kernels.attention import paged_attention
from kernels.conv import causal_conv1d, causal_conv1d_update
from kernels.gdn import gdn_chunk_prefill, gdn_recurrent
from kernels.norm import gated_rms_norm
from tests.helpers.kernel_cases import STATE_TOL, check_pool, conv_case, gdn_case
from tests.helpers.kernel_testing import DEVICE, TOL, assert_close, assert_unchanged, nan_like, to_dev
from tests.kernels.test_attention import make_case as attention_case

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]


@pytest.fixture(autouse=True, scope="module")
def _reference_threads():
    """The CPU references at these sizes take minutes on the suite's 2 threads; a GPU host has cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(before, min(16, os.cpu_count() or 1)))
    yield
    torch.set_num_threads(before)


GDN_HEADS = (16, 32, 128, 128)  # (Hk, Hv, dk, dv)
CONV_DIM = 2 * 16 * 128 + 32 * 128
ATTN_HEADS, HEAD_DIM, BLOCK = (16, 2), 256, 16
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="f32")]
PREFILLS = [pytest.param([4096], id="prefill-4k"), pytest.param([1500, 333, 64, 1], id="prefill-mixed")]
DECODES = [pytest.param([1] * 64, id="decode-b64"), pytest.param([1, 4] * 32, id="decode-b64-spec-k3")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens", PREFILLS)
def test_gdn_chunk_prefill_model_sizes(lens, dtype):
    from kernels.triton.gdn_chunk import gdn_chunk_prefill_triton

    c = gdn_case(lens, GDN_HEADS, dtype, seed=11)
    pool_ref = c.pool.clone()
    o_ref = gdn_chunk_prefill(c.q, c.k, c.v, c.g, c.beta, c.cu, pool_ref, c.slots, c.has_init)
    pool, slots, has_init = to_dev(c.pool.clone(), c.slots, c.has_init)
    o = gdn_chunk_prefill_triton(*c.args(DEVICE), pool, slots, has_init, out=nan_like(o_ref).to(DEVICE))
    assert_close("o", o, o_ref, TOL[dtype])
    check_pool("chunk prefill", pool, pool_ref, c.pool, c)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens", DECODES)
def test_gdn_recurrent_model_sizes(lens, dtype):
    from kernels.triton.gdn_recurrent import gdn_recurrent_triton

    c = gdn_case(lens, GDN_HEADS, dtype, seed=12)
    inter_ref = torch.full((len(lens), max(lens), *c.pool.shape[1:]), float("nan"))
    pool_ref = c.pool.clone()
    o_ref = gdn_recurrent(
        c.q, c.k, c.v, c.g, c.beta, c.cu, pool_ref, c.slots, c.has_init, intermediate_states=inter_ref
    )
    pool, slots, has_init = to_dev(c.pool.clone(), c.slots, c.has_init)
    inter = nan_like(inter_ref).to(DEVICE)
    o = gdn_recurrent_triton(*c.args(DEVICE), pool, slots, has_init, intermediate_states=inter)
    assert_close("o", o, o_ref, TOL[dtype])
    check_pool("recurrent", pool, pool_ref, c.pool, c)
    inter = inter.cpu()
    for b, n in enumerate(lens):
        assert_close(f"intermediate states row {b}", inter[b, :n], inter_ref[b, :n], STATE_TOL)
        assert_unchanged(f"intermediate entries past row {b}'s {n} tokens", inter[b, n:], inter_ref[b, n:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens", PREFILLS)
def test_conv_prefill_model_sizes(lens, dtype):
    from kernels.triton.conv import causal_conv1d_triton

    x, w, cu, pool0, slots, others, has_init = conv_case(lens, CONV_DIM, dtype, seed=13)
    pool_ref = pool0.clone()
    y_ref = causal_conv1d(x, w, cu, pool_ref, slots, has_init)
    pool = pool0.clone().to(DEVICE)
    y = causal_conv1d_triton(*to_dev(x, w, cu), pool, *to_dev(slots, has_init), out=nan_like(y_ref).to(DEVICE))
    assert_close("y", y, y_ref, TOL[dtype])
    assert_close("conv state", pool.cpu()[slots], pool_ref[slots], TOL[dtype])
    assert_unchanged("slots not in the batch", pool.cpu()[others], pool0[others])


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_update_model_sizes(dtype):
    from kernels.triton.conv import causal_conv1d_update_triton

    x, w, _, pool0, slots, others, _ = conv_case([1] * 64, CONV_DIM, dtype, seed=14, has_init=[True] * 64)
    pool_ref = pool0.clone()
    y_ref = causal_conv1d_update(x, w, pool_ref, slots)
    pool = pool0.clone().to(DEVICE)
    y = causal_conv1d_update_triton(*to_dev(x, w), pool, slots.to(DEVICE), out=nan_like(y_ref).to(DEVICE))
    assert_close("y", y, y_ref, TOL[dtype])
    assert_close("conv state", pool.cpu()[slots], pool_ref[slots], TOL[dtype])
    assert_unchanged("slots not in the batch", pool.cpu()[others], pool0[others])


def _decode_rows(n: int, q_len: int, seed: int) -> list[tuple[int, int]]:
    ctx = torch.randint(q_len, 4097, (n,), generator=torch.Generator().manual_seed(seed))
    return [(q_len, int(c)) for c in ctx]


ATTENTION_BATCHES = [
    pytest.param([(4096, 4096)], id="prefill-4k"),
    pytest.param([(2048, 4096), (1000, 1000), (1, 3000)], id="chunked-prefill-2k-of-4k-mixed"),
    pytest.param(_decode_rows(64, 1, seed=15), id="decode-b64"),
    pytest.param(_decode_rows(64, 4, seed=16), id="decode-b64-spec-k3"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ATTENTION_BATCHES)
def test_paged_attention_model_sizes(rows, dtype):
    from kernels.triton.paged_attention import paged_attention_triton

    q, pool, ref_pool, cu, seq_lens, tables = attention_case(rows, ATTN_HEADS, dtype, BLOCK, seed=17, hd=HEAD_DIM)
    scale = HEAD_DIM**-0.5
    o_ref = paged_attention(q, ref_pool, cu, seq_lens, tables, scale)
    o = paged_attention_triton(*to_dev(q, pool, cu, seq_lens, tables), scale, out=nan_like(o_ref).to(DEVICE))
    assert_close("o", o, o_ref, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm_model_sizes(dtype):
    from kernels.triton.norm import gated_rms_norm_triton

    gen = torch.Generator().manual_seed(18)
    shape = (4096, GDN_HEADS[1], GDN_HEADS[3])
    x = torch.randn(shape, generator=gen).to(dtype)
    z = torch.randn(shape, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    assert_close("y", gated_rms_norm_triton(*to_dev(x, z, w), 1e-6), gated_rms_norm(x, z, w, 1e-6), TOL[dtype])

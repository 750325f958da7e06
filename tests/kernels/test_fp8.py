"""Block-quantized FP8 weights: dequantization against a per-block loop, quantization in the
published layout (scale_inv = block amax / 448), the round trip, and the block-scaled GEMM
(Triton, tiny shapes under the interpreter; realistic shapes on a GPU) against its reference."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8 import (
    FP8_MAX,
    cat_fp8_block,
    dequant_fp8_block,
    fp8_block_linear,
    fp8_block_linear_ref,
    narrow_fp8_block,
    quant_fp8_block,
)
from tests.helpers.kernel_testing import NAIVE_TOL, TOL, assert_close, to_dev

# (N, K, block): whole blocks, partial edge blocks on both axes, the published [128, 128].
SHAPES = [
    pytest.param((64, 96, (32, 32)), id="N64-K96-b32"),
    pytest.param((50, 70, (16, 32)), id="N50-K70-b16x32-partial"),
    pytest.param((7, 5, (4, 3)), id="N7-K5-b4x3"),
    pytest.param((300, 200, (128, 128)), id="N300-K200-b128"),
]
DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.bfloat16, id="bf16")]


def blocks_of(N, K, block):
    bn, bk = block
    for i in range(0, N, bn):
        for j in range(0, K, bk):
            yield i // bn, j // bk, (slice(i, i + bn), slice(j, j + bk))


def random_weight(shape, seed=0):
    """Rows of very different magnitudes, as trained weights have, so scales differ per block."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen) * torch.logspace(-3, 1, shape[-2])[:, None]


@pytest.mark.parametrize("shape", SHAPES)
def test_dequant_matches_per_block_loop(shape):
    N, K, block = shape
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(N, K, generator=gen) * 100).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    s = torch.rand(-(-N // block[0]), -(-K // block[1]), generator=gen) + 0.1
    ref = torch.empty(N, K)
    for bi, bj, idx in blocks_of(N, K, block):
        ref[idx] = w[idx].float() * s[bi, bj]
    got = dequant_fp8_block(w, s, block, torch.float32)
    assert torch.equal(got, ref)
    assert torch.equal(dequant_fp8_block(w, s, block, torch.bfloat16), ref.bfloat16())


@pytest.mark.parametrize("shape", SHAPES)
def test_quant_is_the_published_layout(shape):
    N, K, block = shape
    w = random_weight((N, K))
    w[:, : block[1]] = 0.0  # some all-zero blocks
    q, s = quant_fp8_block(w, block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (N, K)
    assert s.dtype == torch.float32 and s.shape == (-(-N // block[0]), -(-K // block[1]))
    for bi, bj, idx in blocks_of(N, K, block):
        amax = w[idx].abs().max()
        if amax == 0:
            assert s[bi, bj] == 1.0 and not q[idx].float().any()
        else:
            assert s[bi, bj] == amax / FP8_MAX
            assert q[idx].float().abs().max() == FP8_MAX  # the block's largest element maps to +-448
    # Round trip: e4m3 keeps 3 mantissa bits, so each element is within 2^-4 of its block's amax.
    err = (dequant_fp8_block(q, s, block, torch.float32) - w).abs()
    for bi, bj, idx in blocks_of(N, K, block):
        assert err[idx].max() <= 2**-4 * s[bi, bj] * FP8_MAX


def test_stacked_experts_quantize_per_expert():
    w = random_weight((3, 40, 24))
    q, s = quant_fp8_block(w, (16, 16))
    assert s.shape == (3, 3, 2)
    for e in range(3):
        q_e, s_e = quant_fp8_block(w[e], (16, 16))
        assert torch.equal(q[e].view(torch.uint8), q_e.view(torch.uint8)) and torch.equal(s[e], s_e)
        got = dequant_fp8_block(q, s, (16, 16), torch.float32)[e]
        assert torch.equal(got, dequant_fp8_block(q_e, s_e, (16, 16), torch.float32))


def test_fp8_rejects_bad_arguments():
    q, s = quant_fp8_block(random_weight((40, 24)), (16, 16))
    want = r"scale_inv must be float32 \(3, 2\) for w \(40, 24\) in blocks \(16, 16\) \(got \(2, 2\):torch.float32\)"
    with pytest.raises(ValueError, match=want):
        dequant_fp8_block(q, s[:2], (16, 16), torch.float32)
    with pytest.raises(ValueError, match=r"got w=\(40, 24\):float32"):
        dequant_fp8_block(q.float(), s, (16, 16), torch.float32)
    with pytest.raises(ValueError, match=r"block_size"):
        quant_fp8_block(torch.zeros(4, 4), (0, 4))


def check_linear(T, N, K, block, dtype, seed=0):
    from kernels.triton.fp8 import fp8_block_linear_triton

    q, s = quant_fp8_block(random_weight((N, K), seed), block)
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    ref = fp8_block_linear_ref(x, q, s, block)
    y = fp8_block_linear_triton(*to_dev(x, q, s), block)
    assert y.dtype == dtype and y.shape == (T, N)
    assert_close("y", y, ref, TOL[dtype])
    return y, ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "case",
    [(1, 40, 64, (16, 32)), (5, 33, 50, (8, 24)), (17, 20, 48, (16, 16))],
    ids=["T1-N40-K64-b16x32", "T5-N33-K50-b8x24-unaligned", "T17-N20-K48-b16"],
)
def test_fp8_block_linear_triton_tiny(case, dtype):
    """Tiny shapes (under the interpreter without a GPU): scale tiles aligned with the K tile, and
    block sizes that are not (per-element scales)."""
    check_linear(*case, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 16, 300], ids=lambda t: f"T{t}")
def test_fp8_block_linear_triton_gpu(T, dtype):
    """Published block size, per-rank Qwen3.5-like projection sizes, N and K not multiples of 128."""
    check_linear(T, 4096 + 64, 2048 + 96, (128, 128), dtype)


def test_fp8_block_linear_reference_is_the_dequantized_gemm():
    q, s = quant_fp8_block(random_weight((24, 40)), (16, 16))
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    ref = x.double() @ dequant_fp8_block(q, s, (16, 16), torch.float32).double().T
    assert_close("y", fp8_block_linear_ref(x, q, s, (16, 16)), ref, NAIVE_TOL)


@pytest.mark.parametrize(
    "dim,start,length",
    [(0, 0, 64), (0, 64, 64), (0, 96, 48), (0, 120, 24), (1, 0, 100), (1, 33, 40), (1, 160, 40)],
    ids=[
        "rows-first-half",
        "rows-second-half",
        "rows-mid-block",
        "rows-to-end",
        "cols-partial",
        "cols-odd",
        "cols-to-end",
    ],
)
def test_narrow_fp8_block_matches_narrowed_dequant(dim, start, length):
    """A tensor-parallel slice that starts or ends inside a block keeps exactly its weights."""
    w, s = quant_fp8_block(random_weight((144, 200)), (32, 64))
    part, part_s, block = narrow_fp8_block(w, s, (32, 64), dim, start, length)
    ref = dequant_fp8_block(w, s, (32, 64), torch.float32).narrow(dim, start, length)
    assert torch.equal(dequant_fp8_block(part, part_s, block, torch.float32), ref)


def test_narrow_fp8_block_parts_concatenate():
    """[gate | up] of one rank: two parts of equal length share a block size and concatenate."""
    w, s = quant_fp8_block(random_weight((2 * 96, 40)), (64, 16))  # I = 96, 2 ranks of 48 rows
    full = dequant_fp8_block(w, s, (64, 16), torch.float32)
    for r in range(2):
        (g, gs, gb), (u, us, ub) = (narrow_fp8_block(w, s, (64, 16), 0, off + r * 48, 48) for off in (0, 96))
        assert gb == ub == (16, 16)
        got = dequant_fp8_block(torch.cat([g, u]), torch.cat([gs, us]), gb, torch.float32)
        assert torch.equal(got, torch.cat([full[r * 48 : (r + 1) * 48], full[96 + r * 48 : 96 + (r + 1) * 48]]))
    with pytest.raises(ValueError, match=r"cannot narrow w \(192, 40\) on dim 0 to \[180, 200\)"):
        narrow_fp8_block(w, s, (64, 16), 0, 180, 20)


def _gdn_like_rank():
    """Rank 1 of 2 of a fused projection stored in [32, 16] blocks: runs of rows that start and end
    inside blocks (q, k, v heads of 12, 12 and 20 rows), concatenated by cat_fp8_block."""
    w, s = quant_fp8_block(random_weight((144, 48)), (32, 16))
    runs = [(12, 12), (60, 12), (120, 20)]
    parts = [narrow_fp8_block(w, s, (32, 16), 0, a, n) for a, n in runs]
    full = dequant_fp8_block(w, s, (32, 16), torch.float32)
    return cat_fp8_block(parts, 0), torch.cat([full[a : a + n] for a, n in runs])


def test_cat_fp8_block_keeps_every_parts_weights():
    (w, s, block), ref = _gdn_like_rank()
    assert block == (4, 16) and tuple(s.shape) == (11, 3)
    assert torch.equal(dequant_fp8_block(w, s, block, torch.float32), ref)
    cw, cs, cb = cat_fp8_block([narrow_fp8_block(w, s, block, 1, a, 24) for a in (0, 24)], 1)
    assert cb == (4, 8) and torch.equal(dequant_fp8_block(cw, cs, cb, torch.float32), ref)
    with pytest.raises(ValueError, match="must share their other block size"):
        cat_fp8_block([(w, s, block), narrow_fp8_block(w, s, block, 1, 0, 24)], 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_block_linear_triton_on_concatenated_slices(dtype, monkeypatch):
    """The GEMM a dense projection kept in FP8 runs (PDSERVE_FORCE_TRITON: Triton, under the
    interpreter without a GPU) on a slice with 4-row scale blocks, against the dequantized rows."""
    (w, s, block), ref_w = _gdn_like_rank()
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(4)).to(dtype)
    monkeypatch.setenv("PDSERVE_FORCE_TRITON", "1")
    y = fp8_block_linear(*to_dev(x, w, s), block)
    assert_close("y", y, x.double() @ ref_w.double().T, NAIVE_TOL if dtype == torch.float32 else TOL[dtype])

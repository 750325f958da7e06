"""The batch-invariant bfloat16 GEMM (`cpu_ops.gemm_bf16`, kernels/csrc/gemm_bf16.cpp) bit for bit
against the float32 loop its source defines (VDPBF16PS's steps: per pair of k the odd element's
product added first, each addition rounded to float32, then the sum rounded to bfloat16), on
both paths where the CPU has AVX512-BF16 (the instruction and float32 multiply-adds) and on the
multiply-adds elsewhere; and each row the same bits alone, in slices and on any number of
threads."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(torch.bfloat16), reason="the CPU operators are not built")

PATHS = [False, True] if cpu_ops.available(torch.bfloat16) and cpu_ops.bf16_dot_supported() else [False]
TINY = 2.0**-126  # the smallest normal float32


def _loop(x: torch.Tensor, w: torch.Tensor, flush: bool = False) -> torch.Tensor:
    """y [M, N] bfloat16 for x [M, K], w [N, K] bfloat16: per output, acc += x[k+1] * w[k+1] then
    acc += x[k] * w[k] for k = 0, 2, 4, ..., each product exact and each sum rounded to float32
    (float64 arithmetic, one rounding); `flush`: denormal float32 sums taken as zero."""
    K = x.shape[1]
    xd, wd = x.double(), w.double()
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32)
    for k in range(0, K, 2):
        for j in (k + 1, k):
            if j < K:
                acc = (acc.double() + xd[:, j : j + 1] * wd[:, j][None]).float()
                if flush:
                    acc = torch.where(acc.abs() < TINY, torch.zeros_like(acc), acc)
    return acc.bfloat16()


def _data(m: int, n: int, k: int, seed: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * scale).bfloat16(), (torch.randn(n, k, generator=g) * 0.05).bfloat16()


SHAPES = [(5, 16, 8), (30, 40, 7), (33, 300, 257), (64, 512, 1024), (13, 17, 1)]


@pytest.mark.parametrize("dot", PATHS, ids=lambda d: "vdpbf16ps" if d else "fma")
@pytest.mark.parametrize("m,n,k", SHAPES, ids=[f"M{m}-N{n}-K{k}" for m, n, k in SHAPES])
def test_gemm_bf16_is_the_float32_loop_bit_for_bit(m, n, k, dot):
    x, w = _data(m, n, k, seed=m + n + k)
    wp = cpu_ops.pack_bf16(w)
    assert tuple(wp.shape) == ((n + 15) // 16, (k + 1) // 2, 16, 2)
    ref = _loop(x, w)
    for threads in (1, 2):
        y = cpu_ops.gemm_bf16(x, wp, n, threads, dot)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        assert torch.equal(y, ref), f"{int((y != ref).sum())} of {y.numel()} differ, threads={threads}"


def test_the_loop_tells_the_order_apart():
    """The loop's order shows in the bits at this size (so the test above pins it): summing the
    even element of each pair first gives other bfloat16 results for some outputs."""
    x, w = _data(64, 512, 1024, seed=1)
    swapped = torch.arange(1024).view(-1, 2).flip(1).reshape(-1)
    assert not torch.equal(_loop(x[:, swapped], w[:, swapped]), _loop(x, w))


@pytest.mark.parametrize("dot", PATHS, ids=lambda d: "vdpbf16ps" if d else "fma")
def test_denormal_inputs_and_sums_are_flushed(dot):
    """Products near float32's smallest normal: sums that would be denormal are zero on both paths."""
    x, w = _data(24, 48, 64, seed=2, scale=2.0**-115)
    w = (w.float() * 2.0**-10).bfloat16()
    ref = _loop(x, w, flush=True)
    assert not torch.equal(ref, _loop(x, w)), "no sum fell below the smallest normal: the test is too weak"
    assert torch.equal(cpu_ops.gemm_bf16(x, cpu_ops.pack_bf16(w), 48, 1, dot), ref)


@pytest.mark.parametrize("dot", PATHS, ids=lambda d: "vdpbf16ps" if d else "fma")
def test_each_row_is_the_same_bits_at_any_row_count_and_thread_count(dot):
    x, w = _data(300, 200, 96, seed=3)
    wp = cpu_ops.pack_bf16(w)
    whole = cpu_ops.gemm_bf16(x, wp, 200, 2, dot)
    for rows in (1, 2, 7, 12, 13, 25, 100):
        for start in (0, 5, 300 - rows):
            for threads in (1, 2):
                part = cpu_ops.gemm_bf16(x[start : start + rows], wp, 200, threads, dot)
                assert torch.equal(part, whole[start : start + rows]), (rows, start, threads)


def test_dot_is_refused_where_the_cpu_lacks_it():
    if cpu_ops.bf16_dot_supported():
        return
    x, w = _data(2, 16, 8, seed=4)
    with pytest.raises(RuntimeError, match="dot=True needs AVX512-BF16"):
        cpu_ops.gemm_bf16(x, cpu_ops.pack_bf16(w), 16, 1, True)

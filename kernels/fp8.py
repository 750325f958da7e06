"""Block-quantized FP8 weights as the Qwen3.5 FP8 checkpoints store them (float8_e4m3fn with a
float32 scale_inv per [bn, bk] block): dequantize, quantize, narrow a TP slice, and
`fp8_block_linear` (Triton on CUDA, a dequantizing reference elsewhere). Shapes: docs/kernels.md."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels.checks import check_fp8_block
from kernels.triton import force_triton as _force_triton

__all__ = [
    "FP8_MAX",
    "dequant_fp8_block",
    "quant_fp8_block",
    "narrow_fp8_block",
    "cat_fp8_block",
    "fp8_block_linear",
    "fp8_block_linear_ref",
]

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def _padded_blocks(x: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """float32 [..., N, K] -> [..., nN, bn, nK, bk], zero-padded to whole blocks."""
    N, K = x.shape[-2:]
    nN, nK = -(-N // bn), -(-K // bk)
    x = F.pad(x, (0, nK * bk - K, 0, nN * bn - N))
    return x.view(*x.shape[:-2], nN, bn, nK, bk)


def dequant_fp8_block(w: torch.Tensor, scale_inv: torch.Tensor, block_size, dtype: torch.dtype) -> torch.Tensor:
    """[..., N, K] in dtype: each element times its block's scale_inv, in float32."""
    bn, bk = check_fp8_block(w, scale_inv, block_size)
    N, K = w.shape[-2:]
    blocks = _padded_blocks(w.float(), bn, bk).mul_(scale_inv[..., :, None, :, None])
    return blocks.flatten(-4, -3).flatten(-2, -1)[..., :N, :K].to(dtype)


def quant_fp8_block(w: torch.Tensor, block_size) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (any float dtype) -> (w_fp8 [..., N, K] float8_e4m3fn, scale_inv float32
    [..., ceil(N/bn), ceil(K/bk)]) with scale_inv = the block's amax / 448."""
    if len(block_size) != 2 or min(block_size) < 1 or w.dim() < 2 or not w.is_floating_point():
        got = f"{tuple(w.shape)}:{w.dtype}, {tuple(block_size)}"
        raise ValueError(f"w must be a float [..., N, K] tensor and block_size (bn, bk) >= 1 (got {got})")
    bn, bk = (int(b) for b in block_size)
    N, K = w.shape[-2:]
    blocks = _padded_blocks(w.float(), bn, bk)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., nN, nK]
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv[..., :, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-4, -3).flatten(-2, -1)[..., :N, :K].contiguous(), scale_inv


def narrow_fp8_block(
    w: torch.Tensor, scale_inv: torch.Tensor, block_size, dim: int, start: int, length: int
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """w.narrow(dim, start, length) for dim one of the last two axes, with its scales:
    (w part, scale_inv part, block size). Along dim the block becomes gcd(block, start, length)
    (length alone when the part runs to the end), so parts of equal length from every rank share
    one block size and concatenate along dim like plain tensors."""
    bn, bk = check_fp8_block(w, scale_inv, block_size)
    axis = dim % w.dim()
    if axis < w.dim() - 2 or not 0 <= start <= start + length <= w.shape[axis] or length < 1:
        raise ValueError(f"cannot narrow w {tuple(w.shape)} on dim {dim} to [{start}, {start + length})")
    last = axis == w.dim() - 1
    b = bk if last else bn
    fine = math.gcd(b, start, length) if start + length < w.shape[axis] else math.gcd(b, start)
    scales = scale_inv.repeat_interleave(b // fine, dim=axis)
    first, end = start // fine, -(-(start + length) // fine)
    part_scales = scales.narrow(axis, first, end - first).contiguous()
    return w.narrow(axis, start, length).contiguous(), part_scales, (bn, fine) if last else (fine, bk)


def cat_fp8_block(parts, dim: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """Concatenate (w, scale_inv, block size) parts along dim (one of the last two axes) into one
    (w, scale_inv, block size). Along dim the block becomes the gcd of the parts' blocks and of
    every part's length but the last's, so each part's scales stay on its own rows; across dim
    the parts must share their block."""
    if not parts:
        raise ValueError("cat_fp8_block needs at least one part")
    checked = [(w, s, check_fp8_block(w, s, b)) for w, s, b in parts]
    axis = dim % checked[0][0].dim()
    if axis < checked[0][0].dim() - 2:
        raise ValueError(f"cat_fp8_block concatenates along one of the last two axes (got dim {dim})")
    last = axis == checked[0][0].dim() - 1
    across = {b[0] if last else b[1] for _, _, b in checked}
    if len(across) != 1:
        raise ValueError(f"parts concatenated along dim {dim} must share their other block size (got {across})")
    fine = 0
    for i, (w, _, b) in enumerate(checked):
        fine = math.gcd(fine, b[1] if last else b[0])
        if i < len(checked) - 1:
            fine = math.gcd(fine, w.shape[axis])
    scales = []
    for w, s, b in checked:
        rep = s.repeat_interleave((b[1] if last else b[0]) // fine, dim=axis)
        scales.append(rep.narrow(axis, 0, -(-w.shape[axis] // fine)))
    ws = torch.cat([w for w, _, _ in checked], dim=axis)
    other = across.pop()
    return ws, torch.cat(scales, dim=axis).contiguous(), (other, fine) if last else (fine, other)


def fp8_block_linear_ref(x: torch.Tensor, w_fp8: torch.Tensor, scale_inv: torch.Tensor, block_size) -> torch.Tensor:
    """x [T, K] @ W^T -> [T, N] in x's dtype, W dequantized into x's dtype (the reference)."""
    return F.linear(x, dequant_fp8_block(w_fp8, scale_inv, block_size, x.dtype))


def fp8_block_linear(x: torch.Tensor, w_fp8: torch.Tensor, scale_inv: torch.Tensor, block_size) -> torch.Tensor:
    """x [T, K], w_fp8 [N, K], scale_inv [ceil(N/bn), ceil(K/bk)] -> [T, N] in x's dtype."""
    if x.is_cuda or _force_triton():
        from kernels.triton.fp8 import fp8_block_linear_triton

        return fp8_block_linear_triton(x, w_fp8, scale_inv, block_size)
    return fp8_block_linear_ref(x, w_fp8, scale_inv, block_size)

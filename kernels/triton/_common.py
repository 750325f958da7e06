"""Argument checks the Triton wrappers add on top of kernels/checks.py: the kernels index with
explicit strides and assume a unit stride on the last axis, integer index tensors and the
dtypes they write."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INDEX_DTYPES = (torch.int32, torch.int64)
TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def round_to(x, DT: tl.constexpr):
    """float32 x rounded to DT (round to nearest even), returned as float32. bfloat16 is rounded
    by hand: the interpreter truncates on a cast, which would double the error of each step."""
    if DT == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        return u.to(tl.float32, bitcast=True)
    else:
        return x.to(DT).to(tl.float32)


def interpreted() -> bool:
    """Whether the kernels run under Triton's interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_in_f32(dtype: torch.dtype) -> bool:
    """Whether `dot` should multiply in float32 (IEEE): for float32 operands (no TF32), and under
    the interpreter, whose 16-bit dots are wrong. A 16-bit dot accumulates in float32 and products
    of 16-bit floats are exact in float32, so both ways give the same sums."""
    return dtype == torch.float32 or interpreted()


def f32_precision() -> str:
    """input_precision for products of computed float32 values: "tf32x3" on a GPU (three TF32
    tensor-core passes, float32-level error), "ieee" under the interpreter. PDSERVE_TRITON_F32_DOT
    (ieee, tf32x3) overrides it on a GPU, to check a result against plain float32 products."""
    if interpreted():
        return "ieee"
    prec = os.environ.get("PDSERVE_TRITON_F32_DOT", "tf32x3")
    if prec not in ("ieee", "tf32x3"):
        raise ValueError(f"PDSERVE_TRITON_F32_DOT must be ieee or tf32x3 (got {prec!r})")
    return prec


@triton.jit
def dot(a, b, F32: tl.constexpr):
    """a @ b accumulated in float32; in float32 (IEEE) when F32, else on the operands' dtype."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


def pow2(n: int, lo: int = 16) -> int:
    """Smallest power of two >= max(n, lo): tile sizes (tl.dot wants >= 16)."""
    return max(lo, triton.next_power_of_2(int(n)))


def token_strides(*tensors: torch.Tensor) -> tuple[int, ...]:
    """(stride over tokens, stride over heads) of each [T, H, ...] tensor, flattened in order: the
    per-token argument block the GDN kernels take."""
    return tuple(s for t in tensors for s in (t.stride(0), t.stride(1)))


def _desc(**tensors: torch.Tensor) -> str:
    return ", ".join(
        f"{n}={tuple(t.shape)}:{str(t.dtype).removeprefix('torch.')} strides {t.stride()}"
        for n, t in tensors.items()
        if t is not None
    )


def check_last_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t is not None and t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride on its last axis (got {_desc(**{name: t})})")


def check_index(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t is not None and (t.dtype not in INDEX_DTYPES or t.dim() != 1):
            raise ValueError(f"{name} must be a 1-D int32/int64 tensor (got {_desc(**{name: t})})")


def check_same_device(**tensors: torch.Tensor) -> None:
    devs = {n: t.device for n, t in tensors.items() if t is not None}
    if len(set(devs.values())) > 1:
        raise ValueError(f"all tensors must be on one device (got {devs})")


def check_flags(name: str, flags: torch.Tensor | None, batch: int) -> None:
    if flags is not None and (flags.dtype != torch.bool or flags.shape != (batch,)):
        raise ValueError(f"{name} must be a bool tensor [B={batch}] (got {_desc(**{name: flags})})")


def check_out(out: torch.Tensor | None, shape: tuple, dtype: torch.dtype, device) -> None:
    if out is None:
        return
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device:
        raise ValueError(
            f"out must be {tuple(shape)}:{str(dtype).removeprefix('torch.')} on {device} (got {_desc(out=out)} on {out.device})"
        )
    check_last_contiguous(out=out)


def row_lengths(cu_seqlens: torch.Tensor) -> list[int]:
    """Per-row token counts on the host (one device sync, which the reference checks also make)."""
    cu = cu_seqlens.tolist()
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if any(n < 0 for n in lens):
        raise ValueError(f"cu_seqlens must be non-decreasing (got {cu})")
    return lens

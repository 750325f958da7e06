"""Argument checks the Triton wrappers add on top of kernels/checks.py: the kernels index with
explicit strides and assume a unit stride on the last axis, integer index tensors and the
dtypes they write."""

from __future__ import annotations

import torch
import triton

INDEX_DTYPES = (torch.int32, torch.int64)


def pow2(n: int, lo: int = 16) -> int:
    """Smallest power of two >= max(n, lo): tile sizes (tl.dot wants >= 16)."""
    return max(lo, triton.next_power_of_2(int(n)))


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

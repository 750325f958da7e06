"""One projection's weight, held in the layout and dtype its device multiplies fastest.

The loader builds a `Linear` from the checkpoint's `[out, in]` weight (already sharded and
fused); layers call it as `lin(x)`, and the LM head is one too. Every choice of layout or GEMM
per dtype, device or CPU capability lives here, so no layer changes with it.

The choice (`Linear.kind`):
    "packed"   float32 on a CPU with the C ops (kernels/cpu_ops.py): the weight packed in panels
               of 16 output columns, `cpu_ops.gemm_f32` (register-tiled, rows in L2-sized
               blocks, output panels split over torch's threads with plain pthreads). The only
               copy of the weight.
    "native"   weight `[out, in]` in the model's dtype, `F.linear`. Float32 without the C ops,
               every dtype on CUDA, and bfloat16 / float16 on CPUs whose oneDNN has native
               kernels for them (`torch.ops.mkldnn._is_mkldnn_bf16_supported()`: AVX512-BF16 or AMX).
    "fp32"     a float32 copy of a bfloat16 / float16 weight, `F.linear` on float32 input, the
               output rounded back to the model's dtype: exactly a low-precision GEMM that
               accumulates in float32 (what oneDNN's does), up to the order of the sum. CPUs
               without native bfloat16 / float16 matmul (AVX2, AVX512 without BF16).

Measured on a 2-core AMD EPYC (Zen 3, AVX2 + FMA, no AVX512) with PyTorch 2.13, one thread,
median ms of a 1024 -> 4096 projection at 1 / 16 / 512 rows:
    bfloat16 F.linear              0.81 / 39.8 / 1302
    float32 copy, output rounded   0.55 / 11.5 /   50
    float32 F.linear               0.61 / 11.5 /   51
(768 -> 3072: 0.47 / 7.3 / 239 against 0.26 / 1.4 / 27; float16 F.linear 1024 -> 4096:
0.96 / 25.7 / 305 at 1 / 16 / 256 rows against 1.07 / 9.9 / 47), and `x @ w` over a
transposed weight is slower still in bfloat16 (20 / 356 / 11300 ms). The float32 copy costs
twice the weight memory of bfloat16; the low-precision copy is not kept. On AVX512-BF16 / AMX
CPUs the native path is oneDNN's own bfloat16 GEMM, which those CPUs run at or above float32
speed; it has not been timed on this machine, which has neither.

Float32, same machine, one thread, CPU ms of 256 -> 784 / 256 -> 1024 / 512 -> 256 at 16 rows:
MKL's F.linear 0.153 / 0.217 / 0.114, packed 0.115 / 0.153 / 0.079 (about 40 % more FLOP/s;
at 4 rows 1.8-2.5x, at 1024 rows level); with 2 threads on a loaded machine MKL's OpenMP
barrier made a 16-row GEMM 10-20x slower, the packed GEMM's two threads stayed level.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from kernels import cpu_ops

Kind = Literal["packed", "native", "fp32"]

GEMV_MAX_ROWS = 4  # up to this many rows, a bfloat16 weight is read as it is (kernels/cpu_ops.py)
_GEMV_THREADED = 1 << 20  # weights of at least this many elements split over torch's threads
_GEMM_THREADED = 1 << 18  # packed GEMMs of at least this many multiply-adds split over threads


def gemm_kind(dtype: torch.dtype, device: torch.device) -> Kind:
    """The GEMM a weight of this dtype gets on this device (see the module docstring)."""
    if torch.device(device).type != "cpu":
        return "native"
    if dtype == torch.float32:
        return "packed" if cpu_ops.available(dtype) else "native"
    if dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "native"
    if dtype == torch.float16 and torch.ops.mkldnn._is_mkldnn_fp16_supported():
        return "native"
    return "fp32"


class Linear:
    """y = x @ W^T for W `[out, in]`; x `[T, in]` -> y `[T, out]` in the model's dtype."""

    __slots__ = ("w", "w16", "dtype", "kind", "threads", "shape")

    def __init__(self, weight: torch.Tensor, kind: Kind | None = None):
        if weight.dim() != 2:
            raise ValueError(f"a Linear weight is [out, in]; got shape {tuple(weight.shape)}")
        self.dtype = weight.dtype
        self.shape = tuple(weight.shape)
        self.kind = kind or gemm_kind(weight.dtype, weight.device)
        if self.kind == "packed":
            self.w = cpu_ops.pack_f32(weight)
        else:
            self.w = weight.float().contiguous() if self.kind == "fp32" else weight.contiguous()
        # few rows are bound by reading the weight: keep the bfloat16 one too for the C GEMV
        gemv = self.kind == "fp32" and weight.dtype == torch.bfloat16 and cpu_ops.available()
        self.w16 = weight.contiguous() if gemv else None
        self.threads = torch.get_num_threads() if weight.numel() >= _GEMV_THREADED else 1

    @property
    def weight(self) -> torch.Tensor:
        """The `[out, in]` weight in the model's dtype (a copy when the GEMM keeps another)."""
        if self.kind == "packed":  # [P, K, 16] -> [P * 16, K], padding dropped
            return self.w.transpose(1, 2).reshape(-1, self.shape[1])[: self.shape[0]].contiguous()
        return self.w if self.w.dtype == self.dtype else self.w.to(self.dtype)

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def device(self) -> torch.device:
        return self.w.device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "packed":
            x2 = x.reshape(-1, self.shape[1]).float()
            big = x2.shape[0] * self.shape[0] * self.shape[1] >= _GEMM_THREADED
            y = cpu_ops.gemm_f32(x2, self.w, self.shape[0], torch.get_num_threads() if big else 1)
            return y if x.dim() == 2 else y.view(*x.shape[:-1], self.shape[0])
        if self.w16 is not None and x.shape[0] <= GEMV_MAX_ROWS and x.dim() == 2:
            return cpu_ops.gemv_bf16(x, self.w16, self.dtype, self.threads)
        if self.kind == "fp32":
            return F.linear(x.float(), self.w).to(self.dtype)
        return F.linear(x, self.w)

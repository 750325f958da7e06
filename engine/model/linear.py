"""One projection's weight, held in the layout and dtype its device multiplies fastest: "packed"
(float32 on a CPU with the C ops, panels for `cpu_ops.gemm_f32`), "onednn" (a 16-bit weight on a
CPU with native 16-bit matmul, reordered once into oneDNN's blocked layout: the same products as
`F.linear`, which reorders it every call), "native" (`F.linear` in the model's dtype), "fp32" (a
float32 copy of a 16-bit weight on CPUs without native 16-bit matmul, output rounded back) or "fp8"
(a block-quantized float8 weight kept as the checkpoint stores it, `kernels.fp8_block_linear`,
with an optional unquantized tail of rows).
A bfloat16 weight may be "packed" too (`row_invariant`, --batch-invariant): panels of bfloat16 pairs
for `cpu_ops.gemm_bf16` (AVX512-BF16's dot product where the CPU has it), each output row the same
float32 sum in the same order at any number of rows, rounded to bfloat16. On CUDA `row_invariant`
makes it "invariant": the weight as it is, multiplied by `kernels.gemm_invariant` (Triton at one
fixed tile configuration, no split-K), whose rows do not depend on the number of rows either.
Every layout or GEMM choice lives here (docs/engine.md, "Module notes"; figures in
docs/benchmarks.md)."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from kernels import cpu_ops
from kernels.checks import check_fp8_block
from kernels.fp8 import dequant_fp8_block, fp8_block_linear
from kernels.gemm import gemm_invariant

Kind = Literal["packed", "onednn", "native", "fp32", "fp8", "invariant"]

GEMV_MAX_ROWS = 4  # up to this many rows, a bfloat16 weight is read as it is (kernels/cpu_ops.py)
_GEMV_THREADED = 1 << 20  # weights of at least this many elements split over torch's threads
_GEMM_THREADED = 1 << 18  # packed GEMMs of at least this many multiply-adds split over threads
_BF16_GEMM_THREADED = 1 << 26  # the same for `gemm_bf16` (about four times as fast), or its weight >= _GEMV_THREADED
# ATen/oneDNN GEMMs below both sizes run on one thread: waking torch's sleeping OpenMP threads
# (OMP_WAIT_POLICY=PASSIVE, engine/__init__.py) costs more than they save on a small weight
_ONE_THREAD_WEIGHT = 1 << 20
_ONE_THREAD_MACS = 1 << 27
_ONEDNN = hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def gemm_kind(dtype: torch.dtype, device: torch.device) -> Kind:
    """The GEMM a weight of this dtype gets on this device (see the module docstring)."""
    if torch.device(device).type != "cpu":
        return "native"
    if dtype == torch.float32:
        return "packed" if cpu_ops.available(dtype) else "native"
    if dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "onednn" if _ONEDNN else "native"
    if dtype == torch.float16 and torch.ops.mkldnn._is_mkldnn_fp16_supported():
        return "onednn" if _ONEDNN else "native"
    return "fp32"


class Linear:
    """y = x @ W^T for W `[out, in]`; x `[T, in]` -> y `[T, out]` in the model's dtype."""

    __slots__ = ("w", "w16", "dtype", "kind", "threads", "shape", "small", "scale_inv", "block_size", "tail")

    def __init__(self, weight: torch.Tensor, kind: Kind | None = None):
        self.scale_inv: torch.Tensor | None = None
        self.block_size: tuple[int, int] | None = None
        self.tail: Linear | None = None
        if weight.dim() != 2:
            raise ValueError(f"a Linear weight is [out, in]; got shape {tuple(weight.shape)}")
        self.dtype = weight.dtype
        self.shape = tuple(weight.shape)
        self.kind = kind or gemm_kind(weight.dtype, weight.device)
        if self.kind == "packed":
            bf16 = weight.dtype == torch.bfloat16
            self.w = cpu_ops.pack_bf16(weight) if bf16 else cpu_ops.pack_f32(weight)
        elif self.kind == "onednn":
            self.w = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        else:
            self.w = weight.float().contiguous() if self.kind == "fp32" else weight.contiguous()
        # few rows are bound by reading the weight: keep the bfloat16 one too for the C GEMV
        gemv = self.kind == "fp32" and weight.dtype == torch.bfloat16 and cpu_ops.available()
        self.w16 = weight.contiguous() if gemv else None
        self.threads = torch.get_num_threads() if weight.numel() >= _GEMV_THREADED else 1
        self.small = weight.device.type == "cpu" and weight.numel() < _ONE_THREAD_WEIGHT

    @classmethod
    def fp8(
        cls,
        weight: torch.Tensor,
        scale_inv: torch.Tensor,
        block_size: tuple[int, int],
        dtype: torch.dtype,
        tail: torch.Tensor | None = None,
    ) -> Linear:
        """A float8_e4m3fn weight `[N, K]` kept as stored, with its float32 `scale_inv` per
        `block_size` block; inputs and outputs in `dtype`. `tail` `[N2, K]` (in `dtype`): rows the
        checkpoint left unquantized, appended to the output (y is `[T, N + N2]`)."""
        bn, bk = check_fp8_block(weight, scale_inv, block_size)
        if weight.dim() != 2 or (tail is not None and (tail.dim() != 2 or tail.shape[1] != weight.shape[1])):
            got = None if tail is None else tuple(tail.shape)
            raise ValueError(f"an FP8 Linear is [N, K] with a tail [N2, K]; got {tuple(weight.shape)}, tail {got}")
        self = cls.__new__(cls)
        self.kind, self.dtype, self.w, self.scale_inv = "fp8", dtype, weight.contiguous(), scale_inv.contiguous()
        self.block_size, self.w16, self.threads, self.small = (bn, bk), None, 1, False
        self.tail = None if tail is None else cls(tail.to(dtype))
        self.shape = (weight.shape[0] + (0 if tail is None else tail.shape[0]), weight.shape[1])
        return self

    @property
    def weight(self) -> torch.Tensor:
        """The `[out, in]` weight in the model's dtype (a copy when the GEMM keeps another)."""
        if self.kind == "fp8":
            assert self.scale_inv is not None and self.block_size is not None
            w = dequant_fp8_block(self.w, self.scale_inv, self.block_size, self.dtype)
            return w if self.tail is None else torch.cat([w, self.tail.weight])
        if self.kind == "packed":  # [P, K, 16] or bfloat16 [P, K/2, 16, 2] -> [P * 16, K], padding dropped
            n, k = self.shape
            if self.w.dim() == 4:
                return self.w.transpose(1, 2).reshape(-1, self.w.shape[1] * 2)[:n, :k].contiguous()
            return self.w.transpose(1, 2).reshape(-1, k)[:n].contiguous()
        if self.kind == "onednn":
            return self.w.to_dense()
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
        if self.kind == "fp8":
            return self._fp8(x)
        if self.kind == "packed":
            x2 = x.reshape(-1, self.shape[1])
            macs = x2.shape[0] * self.shape[0] * self.shape[1]
            if self.dtype == torch.float32:
                threads = torch.get_num_threads() if macs >= _GEMM_THREADED else 1
                y = cpu_ops.gemm_f32(x2.float(), self.w, self.shape[0], threads)
            else:
                big = macs >= _BF16_GEMM_THREADED or self.threads > 1  # or a weight a thread reads too slowly
                threads = torch.get_num_threads() if big else 1
                y = cpu_ops.gemm_bf16(x2.to(self.dtype), self.w, self.shape[0], threads)
            return y if x.dim() == 2 else y.view(*x.shape[:-1], self.shape[0])
        if self.kind == "invariant":
            y = gemm_invariant(x.reshape(-1, self.shape[1]).to(self.dtype), self.w)
            return y if x.dim() == 2 else y.view(*x.shape[:-1], self.shape[0])
        if self.w16 is not None and x.shape[0] <= GEMV_MAX_ROWS and x.dim() == 2:
            return cpu_ops.gemv_bf16(x, self.w16, self.dtype, self.threads)
        if self.small and x.numel() * self.shape[0] < _ONE_THREAD_MACS and (n := torch.get_num_threads()) > 1:
            torch.set_num_threads(1)
            try:
                return self._aten(x)
            finally:
                torch.set_num_threads(n)
        return self._aten(x)

    def _fp8(self, x: torch.Tensor) -> torch.Tensor:
        """Triton's block-FP8 GEMM on CUDA; on a CPU its PyTorch reference (each call dequantizes)."""
        assert self.scale_inv is not None
        x2 = x.reshape(-1, self.shape[1]).contiguous()
        y = fp8_block_linear(x2, self.w, self.scale_inv, self.block_size)
        if self.tail is not None:
            y = torch.cat([y, self.tail(x2)], dim=-1)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.shape[0])

    def _aten(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.w, None, "none", [], "")
        if self.kind == "fp32":
            return F.linear(x.float(), self.w).to(self.dtype)
        return F.linear(x, self.w)


def row_invariant(lin: Linear) -> Linear:
    """The same projection with each output row the same float32 sum in the same order whatever
    the number of rows, so a token's result does not depend on its step (oneDNN's blocking, and
    cuBLAS's choice of kernel, change the sums with the rows). On the CPU "packed" (`gemm_f32` or
    `gemm_bf16`, exact products); on CUDA "invariant" (`kernels.gemm_invariant`). A weight kept in
    FP8 is dequantized into the model's dtype first."""
    if lin.device.type not in ("cpu", "cuda") or lin.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f"batch-invariant projections run on the CPU or CUDA in float32 or bfloat16, not {lin.dtype} on {lin.device}"
        )
    if lin.device.type == "cuda":
        return lin if lin.kind == "invariant" else Linear(lin.weight, "invariant")
    if not cpu_ops.available(lin.dtype):
        raise ValueError(f"batch-invariant projections need the CPU operators: {cpu_ops.status()}")
    return lin if lin.kind == "packed" else Linear(lin.weight, "packed")

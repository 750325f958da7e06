"""Compile the MoE, FP8, sampling, top-k and batch-invariant GEMM Triton kernels for sm_90 (Hopper) without a GPU: type and lowering
errors that the interpreter does not see show up here. Run by test_moe.py in a process without
TRITON_INTERPRET (the interpreter's kernels cannot be compiled).

    python tests/kernels/compile_for_hopper.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels.triton import fp8, gemm_invariant, moe, sampling, topk  # noqa: E402

DTYPES = (("bf16", tl.bfloat16, False), ("fp32", tl.float32, True))
# Pointer arguments by name (without _ptr); the others are activations, or weights ("w").
POINTER_TYPES = {"s": "*fp32", "slot_pair": "*i64", "block_expert": "*i64", "tw": "*fp32", "out": "*fp32"}


def compile_kernel(kernel, xdt: str, scaled: bool, constexprs: dict) -> None:
    sig = {}
    for name in kernel.arg_names:
        base = name.removesuffix("_ptr")
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = POINTER_TYPES.get(base, "*fp8e4nv" if base == "w" and scaled else "*" + xdt)
        else:
            sig[name] = "i32"
    triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))


def main() -> None:
    for xdt, tdt, f32 in DTYPES:
        for scaled in (False, True):
            for kernel, bm in ((moe._moe_up_kernel, 16), (moe._moe_down_kernel, 64)):
                ce = dict(BM=bm, BN=64, BK=128 if scaled else 64, SCALED=scaled, ALIGNED=True, XDT=tdt, DOT_F32=f32)
                compile_kernel(kernel, xdt, scaled, ce)
        for aligned in (True, False):
            ce = dict(BM=16, BN=64, BK=128 if aligned else 32, ALIGNED=aligned, XDT=tdt, DOT_F32=f32)
            compile_kernel(fp8._fp8_block_linear_kernel, xdt, True, ce)
    compile_sampling()
    compile_topk()
    compile_gemm_invariant()
    print("compiled")


def compile_sampling() -> None:
    """The sampler's kernels (kernels/triton/sampling.py), with the argument types the engine
    passes them."""
    f32, i64 = "*fp32", "*i64"
    draw = dict(vals=f32, ids=i64, temp=f32, topk=i64, topp=f32, minp=f32, seed=i64, ctr=i64, seeded=i64)
    draw |= dict(rand=i64, total=f32, q=i64, tokens=i64, held="*i8")
    for has_total in (False, True):
        sig = {n: draw.get(n.removesuffix("_ptr"), "i32") for n in sampling._draw_kernel.arg_names}
        sig |= {"HAS_TOTAL": "constexpr", "BLOCK": "constexpr"}
        ce = {"HAS_TOTAL": has_total, "BLOCK": 1024}
        triton.compile(
            ASTSource(fn=sampling._draw_kernel, signature=sig, constexprs=ce), target=GPUTarget("cuda", 90, 32)
        )
    pen = dict(x=f32, pos=i64, rows=i64, tok=i64, cnt="*i32", inp="*i8", size=i64, rep=f32, pf=f32)
    sig = {n: pen.get(n.removesuffix("_ptr"), "i32") for n in sampling._penalties_kernel.arg_names}
    sig |= {"HAS_REP": "constexpr", "HAS_PF": "constexpr", "BLOCK": "constexpr"}
    ce = {"HAS_REP": True, "HAS_PF": True, "BLOCK": 64}
    triton.compile(
        ASTSource(fn=sampling._penalties_kernel, signature=sig, constexprs=ce), target=GPUTarget("cuda", 90, 32)
    )
    rec = dict(rows=i64, at=i64, tokens=i64, tok=i64, cnt="*i32", size=i64)
    sig = {n: rec.get(n.removesuffix("_ptr"), "i32") for n in sampling._record_kernel.arg_names} | {
        "BLOCK": "constexpr"
    }
    triton.compile(
        ASTSource(fn=sampling._record_kernel, signature=sig, constexprs={"BLOCK": 64}), target=GPUTarget("cuda", 90, 32)
    )


def compile_topk() -> None:
    """The small top-k's four kernels (kernels/triton/topk.py), float32 and bfloat16 logits."""

    def build(fn, args: dict, constexprs: dict) -> None:
        sig = {n: args.get(n.removesuffix("_ptr"), "i32") for n in fn.arg_names} | dict.fromkeys(
            constexprs, "constexpr"
        )
        triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))

    for xdt in ("*fp32", "*bf16"):
        build(topk._block_max, dict(x=xdt, bmax="*i64"), {"BLOCK": 1024})
        build(topk._stage1, dict(x=xdt, thr="*i64", cand="*i64"), {"KPAD": 32, "BLOCK": 1024})
    build(topk._threshold, dict(bmax="*i64", thr="*i64"), {"SB": 256})
    build(topk._stage2, dict(cand="*i64", out_v="*fp32", out_i="*i64"), {"KPAD": 32, "CBLOCK": 8192})


def compile_gemm_invariant() -> None:
    """The batch-invariant GEMM at its one configuration, float32 and bfloat16 (M a plain i32:
    one binary for every row count)."""
    g = gemm_invariant
    for xdt, tdt, f32 in DTYPES:
        ptr = "*" + xdt
        sig = {n: ptr if n.endswith("_ptr") else "i32" for n in g._gemm_invariant_kernel.arg_names}
        ce = dict(BM=g.BLOCK_M, BN=g.BLOCK_N, BK=g.BLOCK_K, YDT=tdt, DOT_F32=f32, ROW_SUMS=False)
        sig |= dict.fromkeys(ce, "constexpr")
        src = ASTSource(fn=g._gemm_invariant_kernel, signature=sig, constexprs=ce)
        triton.compile(
            src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=g.NUM_WARPS, num_stages=g.NUM_STAGES)
        )


if __name__ == "__main__":
    main()

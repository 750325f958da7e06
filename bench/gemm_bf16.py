"""The batch-invariant bfloat16 GEMM against the default one, per projection (not a test): for each
weight shape and row count, the median time of `Linear` as the engine builds it by default
("onednn" where the CPU has native bfloat16 matmul) and of `row_invariant(Linear)` (`gemm_bf16`,
with VDPBF16PS where the CPU has it and with the float32 multiply-adds), threads as the engine
picks them.

    python bench/gemm_bf16.py [--rows 1 16 4096] [--reps 20]

Shapes: the tiny model's projections (hidden 256, intermediate 512: GDN and attention inputs,
MLP gate-up and down, out projections) and one Qwen3.5-like MLP pair (hidden 2048, 6144)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from unittest import mock

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the nodes run, before torch loads
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.timing import call_times  # noqa: E402
from engine.model.linear import Linear, row_invariant  # noqa: E402
from kernels import cpu_ops  # noqa: E402

SHAPES = [(784, 256), (768, 256), (1024, 256), (256, 512), (256, 256), (12288, 2048), (2048, 6144)]


def _median_us(fn, reps: int) -> float:
    return statistics.median(call_times(fn, reps)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 4096])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dot = cpu_ops.bf16_dot_supported()
    print(f"threads {torch.get_num_threads()}, VDPBF16PS: {dot}")
    print("rows  N x K          default us  invariant us  ratio  multiply-adds us  ratio")
    g = torch.Generator().manual_seed(0)
    for m in args.rows:
        totals = [0.0, 0.0, 0.0]
        for n, k in SHAPES:
            w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
            x = torch.randn(m, k, generator=g).bfloat16()
            base, inv = Linear(w), row_invariant(Linear(w))
            reps = max(3, min(args.reps, int(2e9 / (m * n * k))))
            t = [_median_us(lambda: base(x), reps), _median_us(lambda: inv(x), reps)]
            with mock.patch.object(cpu_ops, "bf16_dot_supported", lambda: False):  # a CPU without it (same bits)
                t.append(_median_us(lambda: inv(x), reps))
            totals = [a + b for a, b in zip(totals, t)]
            print(
                f"{m:<5d} {n:>5d} x {k:<5d}  {t[0]:10.1f}  {t[1]:12.1f}  {t[0] / t[1]:5.2f}  {t[2]:16.1f}  "
                f"{t[0] / t[2]:5.2f}"
            )
        print(
            f"{m:<5d} all            {totals[0]:10.1f}  {totals[1]:12.1f}  {totals[0] / totals[1]:5.2f}  "
            f"{totals[2]:16.1f}  {totals[0] / totals[2]:5.2f}"
        )


if __name__ == "__main__":
    main()

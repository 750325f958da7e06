"""The CPU operators a bfloat16 prefill spends most in besides the GEMMs, at the served
benchmark's shapes (not a test): `attn_decode` over 4 x 512 rows of sequences (the batch-invariant
prefill's attention, two passes on two threads) and over 16 decode rows at 600 positions each,
and `gdn_rows` over 4 x 512 rows (bench/vs_vllm_cpu.py's tiny checkpoint: 4 query / 2 KV heads
of 64; 4 key / 8 value heads of 64). Prints each op's median and fastest time.

    python bench/cpu_prefill_ops.py [--reps 30] [--threads 2] [--ops LIB] [--only attn_prefill attn_decode gdn_rows]

`--ops LIB`: time another build of the operators (kernels/_ops/pdserve_cpu_ops.so of a git
worktree at an older commit, built there with `python -m kernels.build`) in place of this tree's,
for a before / after of a kernel change whose operators keep their signatures."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.timing import call_times  # noqa: E402
from kernels import cpu_ops  # noqa: E402
from tests.helpers.kernel_testing import attn_rows_case  # noqa: E402


def timed(fn, reps: int) -> tuple[float, float]:
    """(median, fastest) seconds of fn over reps calls after one warm-up."""
    ts = call_times(fn, reps)
    return statistics.median(ts), min(ts)


def attention(lens: list[int], ctx: list[int], reps: int) -> tuple[float, float]:
    h, kvh, hd, bs = 4, 2, 64, 16
    width = max(ctx) // bs + 2
    g = torch.Generator().manual_seed(0)
    c = attn_rows_case(g, torch.bfloat16, h, kvh, hd, hd // 2, bs, lens, ctx, len(lens) * width + 8, width)
    tables = c["tables"][c["seq"]].contiguous()
    starts = c["starts"] if max(lens) > 1 else None
    args = (c["qkv"], c["qk_norm"], 1e-6, c["cos"], c["sin"], c["pool"], c["slots"], tables, c["pos"] + 1, h, kvh)
    return timed(lambda: cpu_ops.attn_decode(*args, hd**-0.5, seq_starts=starts), reps)


def gdn(reps: int) -> tuple[float, float]:
    hk, hv, dk, dv, kc, lens = 4, 8, 64, 64, 4, [512] * 4
    D, T = 2 * hk * dk + hv * dv, sum(lens)
    g = torch.Generator().manual_seed(0)
    proj = torch.randn(T, D + hv * dv + 2 * hv, generator=g).bfloat16()
    conv_w = (torch.randn(D, kc, generator=g) * 0.5).bfloat16()
    conv_pool = torch.randn(8, D, kc - 1, generator=g).bfloat16()
    rec_pool = torch.randn(8, hv, dk, dv, generator=g) * 0.1
    slots = torch.arange(len(lens))
    consts = (-torch.rand(hv, generator=g) * 2, torch.randn(hv, generator=g), torch.ones(dv).bfloat16())
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    rows = (cu, slots, torch.zeros(len(lens), dtype=torch.bool), torch.repeat_interleave(slots, torch.tensor(lens)))
    return timed(
        lambda: cpu_ops.gdn_rows(proj, *rows, conv_w, conv_pool, rec_pool, *consts, hk, hv, dk, dv, 1e-6), reps
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ops", default=None, help="another build of the operator library to time")
    ap.add_argument("--only", nargs="+", choices=["attn_prefill", "attn_decode", "gdn_rows"], default=None)
    args = ap.parse_args()
    if args.ops:
        torch.ops.load_library(args.ops)
        cpu_ops._state = ""  # loaded: the wrappers call it
    if not cpu_ops.available(torch.bfloat16):
        print(f"the CPU operators are not active: {cpu_ops.status()} (make ops)")
        return 1
    torch.set_num_threads(args.threads)
    lib = args.ops or "this tree's operators"
    print(f"{lib}, {args.threads} threads, bfloat16, median (fastest) of {args.reps}")
    cases = {
        "attn_prefill": ("attn_decode, 4 x 512 prefill rows", lambda: attention([512] * 4, [512] * 4, args.reps)),
        "attn_decode": (
            "attn_decode, 16 decode rows x 600 positions",
            lambda: attention([1] * 16, [600] * 16, args.reps),
        ),
        "gdn_rows": ("gdn_rows, 4 x 512 rows", lambda: gdn(args.reps)),
    }
    rows = {name: run() for key, (name, run) in cases.items() if args.only is None or key in args.only}
    for name, (med, best) in rows.items():
        print(f"  {name:<46}{med * 1e3:8.3f} ms ({best * 1e3:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

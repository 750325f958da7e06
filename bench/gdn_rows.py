"""The C GDN prefill operator alone (not a test): `cpu_ops.gdn_rows` over rows of prompt tokens,
milliseconds per call (one layer) and nanoseconds per (token, value head), medians of --reps.
`--tree DIR` imports the operators from another checkout (built there), for before / after.

    python bench/gdn_rows.py [--tree DIR] [--reps 20] [--dtype bfloat16|float32]"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

# (name, key heads, value heads, dk, dv): the bench checkpoint's, and 128-wide heads as Qwen3.5's
HEADS = [("tiny (4/8 heads, 64)", 4, 8, 64, 64), ("wide (2/4 heads, 128)", 2, 4, 128, 128)]
ROWS = [(4, 512), (1, 2048), (16, 64)]  # (rows, tokens each)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    sys.path.insert(0, args.tree)
    import torch

    from kernels import cpu_ops

    dt = getattr(torch, args.dtype)
    if not cpu_ops.available(dt):
        print(f"the CPU operators are not built in {args.tree}: {cpu_ops.status()}", file=sys.stderr)
        return 1
    print(f"{args.tree}: {args.dtype}, {torch.get_num_threads()} threads")
    g = torch.Generator().manual_seed(0)
    for name, hk, hv, dk, dv in HEADS:
        D, kc = 2 * hk * dk + hv * dv, 4
        for R, L in ROWS:
            T = R * L
            proj = torch.randn(T, D + hv * dv + 2 * hv, generator=g).to(dt)
            cu = torch.arange(0, T + 1, L)
            slots = torch.arange(R)
            rows = (cu, slots, torch.zeros(R, dtype=torch.bool), slots.repeat_interleave(L))
            pools = ((torch.randn(D, kc, generator=g) * 0.3).to(dt), torch.zeros(R, D, kc - 1, dtype=dt))
            rec = torch.zeros(R, hv, dk, dv)
            consts = (-torch.rand(hv, generator=g), torch.rand(hv, generator=g), torch.ones(dv, dtype=dt))
            call = (proj, *rows, *pools, rec, *consts, hk, hv, dk, dv, 1e-6)
            cpu_ops.gdn_rows(*call)
            times = []
            for _ in range(args.reps):
                t = time.perf_counter()
                cpu_ops.gdn_rows(*call)
                times.append(time.perf_counter() - t)
            s = statistics.median(times)
            print(f"  {name:22s} {R:3d} x {L:5d} tokens: {s * 1e3:7.2f} ms, {s / (T * hv) * 1e9:6.0f} ns / token-head")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How long `pdserve up` takes to be ready, and the CPU its processes spend getting there and
stopping, by how it starts its nodes (`--node-start fork`: forked from one launcher that imported
the node code once; `spawn`: each node its own python). The modes alternate pair by pair; medians
with min-max. Not a test.

    python bench/up_start.py [--pairs 3] [--prefill 1] [--decode 2] [--model DIR] [--modes fork spawn]
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def one(mode: str, args: argparse.Namespace) -> tuple[float, float]:
    """(seconds to the ready line, CPU seconds of every process from start to exit)."""
    cmd = [sys.executable, "-m", "router.cli", "up", "--port", "0", "--insecure-open-cluster", "--node-start", mode]
    cmd += ["--prefill", str(args.prefill), "--decode", str(args.decode)] + (
        ["--model", args.model] if args.model else []
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cpu0, t0 = _children_cpu(), time.monotonic()
    p = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert p.stdout is not None
    ready = None
    for line in p.stdout:
        if "pdserve up: ready at" in line:
            ready = time.monotonic() - t0
            p.send_signal(signal.SIGTERM)
    if p.wait() != 0 or ready is None:
        raise SystemExit(f"`pdserve up --node-start {mode}` did not come up (exit {p.returncode})")
    return ready, _children_cpu() - cpu0


def _show(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the built-in tiny model)")
    ap.add_argument("--modes", nargs=2, default=["fork", "spawn"])
    args = ap.parse_args()
    got: dict[str, list[tuple[float, float]]] = {m: [] for m in args.modes}
    for i in range(args.pairs):
        for m in args.modes:
            got[m].append(one(m, args))
            print(f"pair {i + 1} {m}: ready {got[m][-1][0]:.2f} s, CPU {got[m][-1][1]:.1f} s", flush=True)
    print(f"{args.prefill}P+{args.decode}D, {args.pairs} pairs: median (min-max)")
    for m in args.modes:
        print(f"  {m:6s} ready {_show([r for r, _ in got[m]])} s, CPU {_show([c for _, c in got[m]])} s")
    a, b = (got[m] for m in args.modes)
    ratios = [x[0] / y[0] for x, y in zip(a, b)]
    cpu = [x[1] / y[1] for x, y in zip(a, b)]
    print(f"  {args.modes[0]}/{args.modes[1]} pair by pair: ready {_show(ratios)}x, CPU {_show(cpu)}x")


if __name__ == "__main__":
    main()

"""Where a sampler call's time goes on CUDA: batch 64 x 151,936 with Qwen's chat settings (new
rows, then running rows, whose penalty tables are built again each call, then running rows): wall time a call, the
Python functions by own time (cProfile), and the profiler's ops by host time and by GPU time."""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from engine.sampling import Sampler  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.step import RowInput  # noqa: E402

B, V = 64, 151_936
CHAT = dict(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5)


def _caller(running: bool):
    logits = torch.randn(B, V, device="cuda") * 4
    s = Sampler(device="cuda")
    rows = [
        RowInput(
            f"r{b}",
            [7],
            40,
            0,
            [],
            True,
            True,
            params=SamplingParams(**CHAT, seed=b),
            num_draft=0,
            history=(list(range(40)), []),
            num_output=0,
        )
        for b in range(B)
    ]
    work = logits.clone()

    def call():
        work.copy_(logits)
        emitted, _ = s(work, rows, list(range(B)))
        if running:
            for r, toks in zip(rows, emitted):
                r.history[1].append(toks[0])
                r.num_output += 1

    return call


def wall_us(call, n: int = 40) -> tuple[float, float, float]:
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()  # ends in the call's host read
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6, min(ts) * 1e6, max(ts) * 1e6


def main() -> None:
    for running in (False, True):
        med, lo, hi = wall_us(_caller(running))
        print(f"sampler call, running={running}: wall {med:.0f} us (min {lo:.0f}, max {hi:.0f})", flush=True)
    call = _caller(True)
    for _ in range(5):
        call()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        call()
    prof.disable()
    print("== cProfile, running rows, 20 calls, by own time", flush=True)
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(10):
            call()
        torch.cuda.synchronize()
    ka = p.key_averages()
    print("== torch profiler, running rows, per 10 calls", flush=True)
    print(ka.table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=50))
    print(ka.table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=50))


if __name__ == "__main__":
    main()

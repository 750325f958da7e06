"""The scheduler's own cost per step (not a test): schedule + update + final saves with a stand-in
for the model, so only the Python bookkeeping is timed. Best of --reps runs, per workload.

    flock /tmp/pdserve-bench.lock python bench/scheduler.py [--requests 64] [--reps 10]

Workloads: `plain` (no speculation), `drafts-rejected` (n-gram drafts of 2 the stand-in rejects:
depth control drops rows to 0 and probes), `drafts-accepted` (every draft accepted). Prompts of 200
tokens share their first 128, 64 new tokens each, prefix cache on. Uses only the scheduler's public
constructor and steps, so an older checkout runs it too (PYTHONPATH=that checkout)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.cache.block_manager import BlockManager, SlotPool  # noqa: E402
from engine.cache.prefix import PrefixCache  # noqa: E402
from engine.config import SchedulerConfig, SpeculativeConfig  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402

TOKEN = 7  # what the stand-in model samples


def run(num_requests: int, k: int, accept: bool) -> tuple[float, int]:
    """Seconds and steps to run every request to its end."""
    blocks, slots = BlockManager(4096, 16), SlotPool(num_requests)
    prefix = PrefixCache(blocks, 64, interval=64)
    draft = TOKEN if accept else 99
    proposer: Callable[[list[int], int], list[int]] | None = (lambda toks, n: [draft] * n) if k else None
    cfg = SchedulerConfig(max_num_seqs=num_requests, max_num_batched_tokens=2048)
    s = Scheduler(cfg, blocks, slots, 4096, k, proposer, SpeculativeConfig(num_tokens=k), prefix)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    for i in range(num_requests):
        s.add(Request(f"r{i}", list(range(1, 129)) + [1000 + i] * 72, params))
    steps = 0
    t0 = time.perf_counter()
    while s.has_unfinished():
        out = s.schedule()
        sampled = {}
        for r in out.rows:
            if r.samples:
                n = 1 + (len(r.draft_token_ids) if accept else 0)
                sampled[r.request.request_id] = [TOKEN] * n
        s.update(out, sampled, ())
        s.end_final(s.take_final(), ran=True)
        steps += 1
    return time.perf_counter() - t0, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    for name, k, accept in [("plain", 0, False), ("drafts-rejected", 2, False), ("drafts-accepted", 2, True)]:
        secs, steps = min(run(args.requests, k, accept) for _ in range(args.reps))
        print(f"{name:16s} {steps:4d} steps  {secs * 1e3:7.1f} ms  {secs / steps * 1e6:6.0f} us/step")


if __name__ == "__main__":
    main()

"""Chunked prefill's peak memory by prompt length (benchmark, not a test): one fresh process per
length prefills one prompt after a warm-up and reports its peak RSS over the warm engine.

    python bench/prefill_memory.py CKPT [--tokens 2048 8192 16384] [--chunk 1024] [--kv-cache 1GiB]"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(ckpt: str, tokens: int, chunk: int, kv_cache: str) -> str:
    sys.path.insert(0, str(ROOT))
    from engine import SamplingParams  # noqa: PLC0415
    from engine.llm import LLM  # noqa: PLC0415

    llm = LLM(ckpt, dtype="float32", kv_cache_memory=kv_cache, max_num_batched_tokens=chunk, max_num_seqs=2)
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate(prompt_token_ids=[[1] * 64], sampling_params=sp)  # warm-up
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    llm.generate(prompt_token_ids=[[(i * 7) % 1000 for i in range(tokens)]], sampling_params=sp)
    r1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return f"| {tokens} | {chunk} | +{(r1 - r0) / 1024:.0f} | {time.perf_counter() - t:.1f} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ckpt")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 16384])
    ap.add_argument("--chunk", type=int, default=1024, help="--max-num-batched-tokens")
    ap.add_argument("--kv-cache", default="1GiB", help="allocated up front (touched pages count in RSS)")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(one(args.ckpt, args.one, args.chunk, args.kv_cache), flush=True)
        return
    print("| prompt tokens | chunk | peak RSS over the warm engine (MiB) | prefill s |\n|---|---|---|---|")
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    for n in args.tokens:
        cmd = [sys.executable, __file__, args.ckpt, "--one", str(n), "--chunk", str(args.chunk)]
        out = subprocess.run(cmd + ["--kv-cache", args.kv_cache], capture_output=True, text=True, env=env, check=True)
        print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()

"""Prefill throughput by step size (not a test): what capping batch prompt chunks costs
(--batch-chunk-tokens, engine/scheduler/priority.py). The offline engine prefills the same
distinct prompts with max_num_batched_tokens set to each size in turn (a batch prompt capped at N
tokens a step computes in steps of N). One engine per size; the sizes take turns, each prefilling
fresh prompts, --reps rounds; the best rate of each is reported.

    flock /tmp/pdserve-bench.lock python bench/prefill_chunks.py [--sizes 2048 256 128] [--prompts 2] [--prompt-len 3000] [--reps 3]"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint (default: the built-in tiny model)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 256, 128])
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=3000)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    import torch

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from router.cli import default_model_dir

    model = args.model or str(default_model_dir())
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    llms = {n: LLM(model, dtype="float32", max_num_batched_tokens=n, kv_cache_memory="512MiB") for n in args.sizes}
    best = dict.fromkeys(args.sizes, 0.0)
    try:
        for llm in llms.values():  # warm-up
            llm.generate(prompt_token_ids=torch.randint(1, 1000, (1, 64), generator=g).tolist(), sampling_params=sp)
        for _ in range(args.reps):  # sizes interleaved, so a load that drifts weighs on each alike
            for n, llm in llms.items():
                ps = torch.randint(1, 1000, (args.prompts, args.prompt_len), generator=g).tolist()
                t0 = time.monotonic()
                llm.generate(prompt_token_ids=ps, sampling_params=sp)
                best[n] = max(best[n], args.prompts * args.prompt_len / (time.monotonic() - t0))
    finally:
        for llm in llms.values():
            llm.close()
    base = best[args.sizes[0]]
    for n, rate in best.items():
        print(f"step {n:5d} tokens: {rate:7,.0f} prompt tokens/s, best of {args.reps} ({rate / base:.2f}x the first)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

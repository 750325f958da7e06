"""Engine tokens/s of one checkout, one process per run, for A/B runs of two checkouts (not a test).

    python bench/engine_ab.py --tree CHECKOUT --model DIR --dtype float32 --batch 16 [--new-tokens 128]
        [--batch-invariant | --no-batch-invariant]

Greedy, 256-token random prompts (seeded by the batch size), one warm-up generate; prints one JSON
line. Alternate two checkouts run by run under `flock /tmp/pdserve-bench.lock`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the nodes run, before torch loads


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", required=True, help="the checkout whose engine runs")
    ap.add_argument("--model", required=True, help="checkpoint directory (engine.tiny_model writes one)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="batch-invariant mode on or off (default: the checkout's default)",
    )
    args = ap.parse_args()
    sys.path.insert(0, args.tree)
    import torch

    from engine import LLM, SamplingParams

    g = torch.Generator().manual_seed(args.batch)
    prompts = torch.randint(0, 1024, (args.batch, 256), generator=g).tolist()
    extra = {} if args.batch_invariant is None else {"batch_invariant": args.batch_invariant}
    llm = LLM(args.model, dtype=args.dtype, max_num_batched_tokens=4096, **extra)
    warm = SamplingParams(max_tokens=2, temperature=0.0)
    llm.generate(prompt_token_ids=[p[:8] for p in prompts[:2]], sampling_params=warm)
    sp = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    dt = time.perf_counter() - t0
    llm.close()
    row = {
        "tree": args.tree,
        "dtype": args.dtype,
        "batch": args.batch,
        "batch_invariant": args.batch_invariant,
        "tok_s": round(args.batch * args.new_tokens / dt, 1),
    }
    print(json.dumps(row | {"first_tokens": outs[0].output_token_ids[:4]}))


if __name__ == "__main__":
    main()

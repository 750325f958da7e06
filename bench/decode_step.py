"""Wall time of the engine's decode-only steps at one batch size (not a test).

    python bench/decode_step.py [--model DIR] [--batch 16] [--prompt-len 512] [--new-tokens 200] [--reps 3]

`--batch` requests of random `--prompt-len`-token prompts go in at once (the engine's
max_num_seqs is the batch), greedy; every step is timed and the steps after the last prompt
token was computed are the decode-only ones. Prints the median of each repetition, in ms. The
threads are torch's (OMP_NUM_THREADS); the loaded engine's heap is frozen, as in a serving node. The checkpoint defaults to the served benchmark's
(/root/.cache/bench-bf16-tiny, bfloat16). Alternate two builds of the operators run by run under
`flock /tmp/pdserve-bench.lock` for a before / after.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tree's packages, not bench/'s modules

import engine  # noqa: E402, F401  (before torch: the engine's OpenMP policy)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/root/.cache/bench-bf16-tiny")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    from engine import LLM, SamplingParams, heap

    rng = random.Random(0)
    sp = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    meds = []
    with LLM(args.model, max_num_seqs=args.batch, dtype=args.dtype, engine_process=False) as llm:
        eng = llm.engine
        assert eng is not None
        heap.settle()  # as a serving node does once it is up (engine/heap.py): no collector walk in the steps
        for _ in range(args.reps):
            for _ in range(args.batch):
                eng.add_request([rng.randrange(1, 1000) for _ in range(args.prompt_len)], sp)
            steps: list[tuple[float, int]] = []
            while eng.has_unfinished():
                t = time.perf_counter()
                eng.step()
                steps.append((time.perf_counter() - t, eng.prompt_tokens_computed))
            last_prompt = next(i for i, (_, n) in enumerate(steps) if n == steps[-1][1])  # its last tokens' step
            decode = [d for d, _ in steps[last_prompt + 1 :]]
            meds.append(statistics.median(decode) * 1e3)
    print(f"batch {args.batch}: decode step ms, median of each repetition: " + " ".join(f"{m:.3f}" for m in meds))


if __name__ == "__main__":
    main()

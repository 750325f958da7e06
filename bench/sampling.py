"""Sampled vs greedy decode throughput of the offline engine on a checkpoint with Qwen's vocabulary
and few narrow layers, so the LM head and the sampler dominate a step (bfloat16, CPU).

    python bench/sampling.py [--batch 64] [--new-tokens 64] [--reps 3] [--layers 2] [--hidden 256]"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QWEN_CHAT = dict(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5)
VOCAB = 151_936


def make_checkpoint(out: Path, layers: int, hidden: int) -> Path:
    from engine.tiny_model import TinyModelSpec, make_tiny_model

    spec = TinyModelSpec(
        layers=layers,
        hidden=hidden,
        intermediate=2 * hidden,
        vocab=VOCAB,
        dtype="bfloat16",
        full_attention_interval=2,
        tokenizer=False,
        max_positions=1024,
    )
    return make_tiny_model(out, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args()

    from engine import LLM, SamplingParams  # first: the engine sets OpenMP's policy before torch loads

    with tempfile.TemporaryDirectory() as d:
        ckpt = make_checkpoint(Path(d) / "ckpt", args.layers, args.hidden)
        llm = LLM(
            str(ckpt),
            dtype="bfloat16",
            max_num_seqs=args.batch,
            max_num_batched_tokens=4096,
            kv_cache_memory="512MiB",
            enable_prefix_caching=False,
        )
        prompts = [[(97 * b + 13 * i) % VOCAB for i in range(args.prompt_len)] for b in range(args.batch)]
        n = args.new_tokens
        settings = {
            "greedy": [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)] * args.batch,
            "qwen-sampled": [
                SamplingParams(max_tokens=n, ignore_eos=True, seed=1000 + b, **QWEN_CHAT) for b in range(args.batch)
            ],
        }
        llm.generate(prompt_token_ids=prompts[:4], sampling_params=SamplingParams(max_tokens=4, temperature=0.0))
        rates: dict[str, list[float]] = {k: [] for k in settings}
        for _ in range(args.reps):
            for name, sp in settings.items():
                t0 = time.perf_counter()
                outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
                dt = time.perf_counter() - t0
                rates[name].append(sum(len(o.output_token_ids) for o in outs) / dt)
        llm.close()
    load = os.getloadavg()
    print(
        f"batch {args.batch}, {n} new tokens, vocab {VOCAB}, {args.layers} layers, hidden {args.hidden}, bf16, "
        f"{args.reps} reps; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    med = {k: statistics.median(v) for k, v in rates.items()}
    for name, v in rates.items():
        print(f"{name:>13}: {med[name]:8.1f} tok/s  (min {min(v):.1f}, max {max(v):.1f})")
    print(f"sampled / greedy: {med['qwen-sampled'] / med['greedy']:.2f}x")


if __name__ == "__main__":
    main()

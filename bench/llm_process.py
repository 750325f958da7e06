"""The offline LLM from a script that imports torch before the engine (the way users write it):
tokens/s with the engine in the script's process (engine_process=False, under OpenMP's spinning
threads) and in a process of its own (what LLM does by default here), float32, batch 16, greedy.

    python bench/llm_process.py [--batch 16] [--new-tokens 64] [--rounds 2]"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch  # first, on purpose

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM, SamplingParams  # noqa: E402
from engine.tiny_model import TinyModelSpec, make_tiny_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        ckpt = make_tiny_model(Path(d) / "ckpt", TinyModelSpec(tokenizer=False))
        g = torch.Generator().manual_seed(args.batch)
        prompts = torch.randint(0, 1024, (args.batch, 128), generator=g).tolist()
        sp = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
        warm = SamplingParams(max_tokens=2, temperature=0.0)
        for rnd in range(args.rounds):
            for own in (False, True):
                llm = LLM(str(ckpt), dtype="float32", engine_process=own, enable_prefix_caching=False)
                llm.generate(prompt_token_ids=prompts[:2], sampling_params=warm)
                t0 = time.perf_counter()
                outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
                rate = sum(len(o.output_token_ids) for o in outs) / (time.perf_counter() - t0)
                llm.close()
                load = os.getloadavg()[0]
                print(f"round {rnd}, engine_process={own}: {rate:.0f} tokens/s (load {load:.2f})", flush=True)


if __name__ == "__main__":
    main()

"""Engine vs transformers' generate on the tiny checkpoint: new tokens/s and their ratio.

    python bench/engine_vs_transformers.py [--prompt-len 256] [--new-tokens 128] [--batches 1 16]

Same checkpoint (8 layers, hidden 256, 4 key / 8 value GDN heads of 32, 4 query / 2 KV heads
of 64, vocab 1024), greedy, float32, on the CPU. Prints one table row per batch size.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM, SamplingParams  # noqa: E402  (before torch: engine/__init__.py sets the OpenMP wait policy)
import torch  # noqa: E402
from engine.tiny_model import TinyModelSpec, make_tiny_model  # noqa: E402


def bench_transformers(path, prompts, new_tokens):
    from transformers import Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        model.generate(ids[:, :8], attention_mask=torch.ones_like(ids[:, :8]), max_new_tokens=2, do_sample=False)
        t0 = time.perf_counter()
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
        )
        dt = time.perf_counter() - t0
    return out[:, ids.shape[1] :].tolist(), dt


def bench_engine(llm, prompts, new_tokens):
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompt_token_ids=[p[:8] for p in prompts[:2]], sampling_params=SamplingParams(max_tokens=2, temperature=0.0))
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    dt = time.perf_counter() - t0
    return [o.output_token_ids for o in outs], dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as d:
        path = make_tiny_model(Path(d) / "tiny", TinyModelSpec(tokenizer=False))
        llm = LLM(str(path), dtype="float32", max_num_batched_tokens=4096)
        print(f"threads {args.threads}, prompt {args.prompt_len}, new tokens {args.new_tokens}")
        print(f"{'batch':>5} {'engine tok/s':>13} {'transformers tok/s':>19} {'ratio':>6} {'same tokens':>12}")
        for b in args.batches:
            g = torch.Generator().manual_seed(b)
            prompts = torch.randint(0, 1024, (b, args.prompt_len), generator=g).tolist()
            e_tok, e_dt = bench_engine(llm, prompts, args.new_tokens)
            t_tok, t_dt = bench_transformers(path, prompts, args.new_tokens)
            n = b * args.new_tokens
            same = sum(a == c for a, c in zip(e_tok, t_tok))
            print(f"{b:>5} {n / e_dt:>13.1f} {n / t_dt:>19.1f} {t_dt / e_dt:>6.2f} {same:>6}/{b:<5}")
        llm.close()


if __name__ == "__main__":
    main()

"""Engine vs transformers' generate on a tiny checkpoint: new tokens/s and their ratio.

    python bench/engine_vs_transformers.py [--arch qwen3_5|qwen3_5_moe|qwen3_next] [--dtype float32 bfloat16]
                                           [--prompt-len 256] [--new-tokens 128] [--batches 1 16]

Same checkpoint for both (8 layers, hidden 256, 4 key / 8 value GDN heads of 32, 4 query / 2 KV
heads of 64, vocab 1024; the MoE architectures have --experts routed experts of
--moe-intermediate, top --top-k, and a shared expert), greedy, on the CPU, one system at a time.
Prints one table row per dtype and batch size; "same tokens" counts rows equal to transformers'.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# Both systems run with OpenMP threads that sleep at the end of a parallel region, as pdserve's
# servers do (engine/__init__.py sets it, but only when the engine loads before torch).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.tiny_model import TinyModelSpec, make_tiny_model  # noqa: E402

ARCHS = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
         "qwen3_next": "Qwen3NextForCausalLM"}  # fmt: skip


def bench_transformers(path, prompts, new_tokens, dtype):
    import transformers

    cls = getattr(transformers, ARCHS[json.loads((Path(path) / "config.json").read_text())["model_type"]])
    model = cls.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        model.generate(ids[:, :8], attention_mask=torch.ones_like(ids[:, :8]), max_new_tokens=2, do_sample=False)
        t0 = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )
        dt = time.perf_counter() - t0
    return out[:, ids.shape[1] :].tolist(), dt


def bench_engine(llm, prompts, new_tokens):
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(
        prompt_token_ids=[p[:8] for p in prompts[:2]], sampling_params=SamplingParams(max_tokens=2, temperature=0.0)
    )
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
    ap.add_argument("--arch", choices=["qwen3_5", "qwen3_5_moe", "qwen3_next"], default="qwen3_5")
    ap.add_argument("--dtype", nargs="+", choices=["float32", "bfloat16"], default=["float32"])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--moe-intermediate", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = TinyModelSpec(
        arch=args.arch,
        tokenizer=False,
        experts=args.experts,
        top_k=args.top_k,
        moe_intermediate=args.moe_intermediate,
        shared_intermediate=args.moe_intermediate,
    )
    with tempfile.TemporaryDirectory() as d:
        path = make_tiny_model(Path(d) / "tiny", spec)
        moe = f", {spec.experts} experts top-{spec.top_k} of {spec.moe_intermediate}" if args.arch != "qwen3_5" else ""
        print(f"{args.arch}{moe}: threads {args.threads}, prompt {args.prompt_len}, new tokens {args.new_tokens}")
        print(
            f"{'dtype':>9} {'batch':>5} {'engine tok/s':>13} {'transformers tok/s':>19} {'ratio':>6} {'same tokens':>12}"
        )
        for dtype in args.dtype:
            llm = LLM(str(path), dtype=dtype, max_num_batched_tokens=4096)
            for b in args.batches:
                g = torch.Generator().manual_seed(b)
                prompts = torch.randint(0, spec.vocab, (b, args.prompt_len), generator=g).tolist()
                e_tok, e_dt = bench_engine(llm, prompts, args.new_tokens)
                t_tok, t_dt = bench_transformers(path, prompts, args.new_tokens, dtype)
                n = b * args.new_tokens
                same = sum(a == c for a, c in zip(e_tok, t_tok))
                print(f"{dtype:>9} {b:>5} {n / e_dt:>13.1f} {n / t_dt:>19.1f} {t_dt / e_dt:>6.2f} {same:>6}/{b:<5}")
            llm.close()


if __name__ == "__main__":
    main()

"""Engine vs transformers' generate on a tiny checkpoint, greedy on the CPU: new tokens/s and their
ratio, every measurement in its own process under each system's own OpenMP policy.

    python bench/engine_vs_transformers.py [--arch qwen3_5|qwen3_5_moe|qwen3_next] [--dtype float32 bfloat16]
                                           [--prompt-len 256] [--new-tokens 128] [--batches 1 16] [--reps 3]"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHS = {
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}
POLICIES = {"engine": "engine's own", "tf-default": "default", "tf-passive": "PASSIVE"}


def run_engine(path, prompts, new_tokens, dtype):
    from engine import LLM, SamplingParams  # first: the engine sets OpenMP's policy before torch loads

    llm = LLM(str(path), dtype=dtype, max_num_batched_tokens=4096)
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(
        prompt_token_ids=[p[:8] for p in prompts[:2]], sampling_params=SamplingParams(max_tokens=2, temperature=0.0)
    )
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    dt = time.perf_counter() - t0
    llm.close()
    return [o.output_token_ids for o in outs], dt


def run_transformers(path, prompts, new_tokens, dtype):
    import torch
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


def child(args):
    """One measurement, in this process: prints {"tokens", "dt"} as the last line."""
    job = json.loads(Path(args.job).read_text())
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    fn = run_engine if args.child == "engine" else run_transformers
    tokens, dt = fn(job["path"], job["prompts"], job["new_tokens"], job["dtype"])
    print(json.dumps({"tokens": tokens, "dt": dt}))


def measure(system: str, job_file: Path, threads: int) -> tuple[list, float]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if system == "tf-passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    cmd = [sys.executable, __file__, "--child", "engine" if system == "engine" else "transformers"]
    cmd += ["--job", str(job_file), "--threads", str(threads)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        sys.exit(f"{system} run failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return out["tokens"], out["dt"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--threads", type=int, default=0, help="torch threads in each process (0: torch's default)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--arch", choices=["qwen3_5", "qwen3_5_moe", "qwen3_next"], default="qwen3_5")
    ap.add_argument("--dtype", nargs="+", choices=["float32", "bfloat16"], default=["float32"])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--moe-intermediate", type=int, default=128)
    ap.add_argument("--child", choices=["engine", "transformers"], help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))  # before bench/, whose kernels.py would shadow the package
    if args.child:
        return child(args)

    import torch

    from engine.tiny_model import TinyModelSpec, make_tiny_model

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
        threads = args.threads or torch.get_num_threads()
        print(
            f"{args.arch}{moe}: threads {threads}, prompt {args.prompt_len}, new tokens {args.new_tokens}, "
            f"{args.reps} reps, one process per run; tokens/s are medians"
        )
        head = f"{'dtype':>9} {'batch':>5} {'engine':>8} {'tf default':>11} {'tf PASSIVE':>11}"
        print(f"{head} {'ratio':>6} {'ratio range':>12} {'same tokens':>12}", flush=True)
        for dtype in args.dtype:
            for b in args.batches:
                g = torch.Generator().manual_seed(b)
                prompts = torch.randint(0, spec.vocab, (b, args.prompt_len), generator=g).tolist()
                job = Path(d) / "job.json"
                job.write_text(
                    json.dumps(dict(path=str(path), prompts=prompts, new_tokens=args.new_tokens, dtype=dtype))
                )
                times: dict[str, list[float]] = {s: [] for s in POLICIES}
                tokens = {}
                for rep in range(args.reps):
                    order = list(POLICIES) if rep % 2 == 0 else list(reversed(POLICIES))
                    for system in order:
                        tokens[system], dt = measure(system, job, args.threads)
                        times[system].append(dt)
                        print(f"  rep {rep + 1} {system}: {b * args.new_tokens / dt:.1f} tok/s", file=sys.stderr)
                n = b * args.new_tokens
                med = {s: statistics.median(ts) for s, ts in times.items()}
                best_tf = min(med["tf-default"], med["tf-passive"])
                per_rep = [min(a, c) / e for e, a, c in zip(times["engine"], times["tf-default"], times["tf-passive"])]
                same = sum(a == c for a, c in zip(tokens["engine"], tokens["tf-default"]))
                print(
                    f"{dtype:>9} {b:>5} {n / med['engine']:>8.1f} {n / med['tf-default']:>11.1f} "
                    f"{n / med['tf-passive']:>11.1f} {best_tf / med['engine']:>6.2f} "
                    f"{min(per_rep):>5.2f}-{max(per_rep):<5.2f} {same:>6}/{b:<5}",
                    flush=True,
                )


if __name__ == "__main__":
    main()

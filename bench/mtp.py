"""MTP speculative decoding on the CPU: fits the tiny checkpoint's block to the model's greedy
choices, then reports acceptance per draft position and the decode speed-up at each k, on the
fitted prompts and on fresh ones.

    python bench/mtp.py [--prompts 8] [--k 1 2 3] [--reps 3] [--cpu-time] [--threads N] [--save DIR | --model DIR]"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as engine/__init__.py, which loads after torch here

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.tiny_model import TinyModelSpec, fit_mtp_block, make_tiny_model  # noqa: E402


def run(llm: LLM, prompts, sp, batch: int, clock):
    """(tokens, seconds, drafts per position, accepted per position) of one pass over prompts."""
    s = llm.engine.scheduler
    base_d, base_a = list(s.drafts_per_position), list(s.accepted_per_position)
    t0 = clock()
    outs = []
    for i in range(0, len(prompts), batch):
        outs += llm.generate(prompt_token_ids=prompts[i : i + batch], sampling_params=sp)
    dt = clock() - t0
    drafted = [x - y for x, y in zip(s.drafts_per_position, base_d)]
    accepted = [x - y for x, y in zip(s.accepted_per_position, base_a)]
    return [o.output_token_ids for o in outs], dt, drafted, accepted


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fit-steps", type=int, default=300)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--batch", type=int, default=1, help="requests per generate call (1: one at a time)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cpu-time", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--save", default=None, help="keep the fitted checkpoint here")
    ap.add_argument("--model", default=None, help="a checkpoint fitted and saved before (skips the fit)")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    sp = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    sets = {
        name: torch.randint(0, 1024, (args.prompts, args.prompt_len), generator=g).tolist() for name in ("fit", "fresh")
    }
    with tempfile.TemporaryDirectory() as d:
        path = args.model
        if path is None:
            path = str(make_tiny_model(Path(args.save or d) / "tiny-mtp", TinyModelSpec(tokenizer=False, mtp=True)))
            with LLM(path, dtype="float32") as llm:
                conts = llm.generate(prompt_token_ids=sets["fit"], sampling_params=sp)
            seqs = [p + o.output_token_ids for p, o in zip(sets["fit"], conts)]
            t0 = time.perf_counter()
            acc = fit_mtp_block(path, seqs, steps=args.fit_steps, batch=args.prompts)
            print(
                f"fitted the MTP block: {args.fit_steps} steps in {time.perf_counter() - t0:.0f} s, "
                f"training accuracy {acc:.3f}"
            )
        print(
            f"{args.prompts} prompts x {args.prompt_len} tokens, {args.new_tokens} new tokens each, "
            f"{args.batch} request(s) per batch, greedy float32, {torch.get_num_threads()} threads, "
            f"best of {args.reps} ({'CPU' if args.cpu_time else 'wall'} time)"
        )
        ks = [0, *args.k]
        llms = {
            k: LLM(path, dtype="float32", **(dict(speculative_method="mtp", num_speculative_tokens=k) if k else {}))
            for k in ks
        }
        warm = SamplingParams(max_tokens=4, temperature=0.0)
        for llm in llms.values():
            llm.generate(prompt_token_ids=sets["fit"][:1], sampling_params=warm)
        print("| prompts | k | tok/s | speed-up | accepted / drafted at position 1, 2, ... | tokens same |")
        print("|---|---|---|---|---|---|")
        for name, prompts in sets.items():
            best = {k: float("inf") for k in ks}
            res = {}
            for _ in range(args.reps):
                for k in ks:
                    toks, dt, drafted, accepted = run(llms[k], prompts, sp, args.batch, clock)
                    best[k] = min(best[k], dt)
                    res[k] = (toks, drafted, accepted)
            n = len(prompts) * args.new_tokens
            for k in ks:
                toks, drafted, accepted = res[k]
                pos = ", ".join(f"{a}/{d} ({a / d:.2f})" if d else "0/0" for a, d in zip(accepted, drafted)) or "-"
                same = "yes" if toks == res[0][0] else "NO"
                print(f"| {name} | {k} | {n / best[k]:.1f} | {best[0] / best[k]:.2f} | {pos} | {same} |")
        for llm in llms.values():
            llm.close()


if __name__ == "__main__":
    main()

"""How exactly a moved request continues (not a test): for each dtype and sampling setting, a
batch of requests is generated once; then each request is resumed from the first half of its
output (`EngineCore.resume_request`, what a decode node does for a request moved to it: one
prefill of prompt + output, then decoding on) and its second half is compared with the first
run's. Beside it, the same requests generated again in another batch composition (reversed, in
two halves), and again with prompts prefilled in chunks of --small-chunk tokens (as a busy node's
scheduler may cut them): the engine's own agreement with itself, which no move can beat.

    python bench/migration_exact.py [--model DIR] [--requests 16] [--new-tokens 96] [--[no-]batch-invariant]

Reports, per dtype and setting, the streams whose continuation is token-identical and the share
of continued tokens before the first difference."""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "qwen_chat": dict(temperature=0.7, top_p=0.8, top_k=20),
    "top_p": dict(temperature=1.0, top_p=0.95),
    "temperature": dict(temperature=1.0),
}


def _run(core, jobs) -> list[list[int]]:
    """jobs: (prompt, params, output so far or None) -> each job's new tokens, in order."""
    rids = []
    for prompt, params, done in jobs:
        if done is None:
            rids.append(core.add_request(prompt, params))
        else:
            rids.append(core.resume_request(prompt, params, done))
    got: dict[str, list[int]] = {r: [] for r in rids}
    finished: set[str] = set()
    while len(finished) < len(rids):
        for out in core.step():
            got[out.request_id] += out.new_token_ids
            if out.finished:
                finished.add(out.request_id)
    return [got[r] for r in rids]


def _agree(a: list[int], b: list[int]) -> int:
    """Tokens before the first difference."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a checkpoint; default: the built-in tiny model, written here")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--small-chunk", type=int, default=16)
    ap.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the engines in batch-invariant mode or not (default: the engine's default)",
    )
    args = ap.parse_args()

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from engine.tiny_model import make_tiny_model

    model = args.model or str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    rng = random.Random(0)
    half = args.new_tokens // 2
    print(
        f"model {model}, {args.requests} requests, prompt {args.prompt_len}, resumed after {half} of {args.new_tokens}"
    )
    for dtype in args.dtypes:
        llm = LLM(
            model, dtype=dtype, engine_process=False, enable_prefix_caching=False, batch_invariant=args.batch_invariant
        )
        small = LLM(
            model,
            dtype=dtype,
            engine_process=False,
            enable_prefix_caching=False,
            batch_invariant=args.batch_invariant,
            max_num_batched_tokens=args.small_chunk * args.requests,
            batch_chunk_tokens=args.small_chunk,
        )
        core, small_core = llm.engine, small.engine
        assert core is not None and small_core is not None  # engine_process=False: in this process
        vocab = core.cfg.model.vocab_size
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
        for name, kw in SETTINGS.items():
            params = [
                SamplingParams(
                    **kw, max_tokens=args.new_tokens, ignore_eos=True, **({} if name == "greedy" else {"seed": i})
                )
                for i in range(args.requests)
            ]
            first = _run(core, [(p, sp, None) for p, sp in zip(prompts, params)])
            order = list(range(args.requests))[::-1]
            again: list[list[int]] = [[] for _ in range(args.requests)]
            for part in (order[: len(order) // 2], order[len(order) // 2 :]):
                for i, toks in zip(part, _run(core, [(prompts[i], params[i], None) for i in part])):
                    again[i] = toks
            moved = _run(core, [(p, sp, f[:half]) for p, sp, f in zip(prompts, params, first)])
            chunked = _run(small_core, [(p, sp, None) for p, sp in zip(prompts, params)])
            rerun_same = sum(a == f for a, f in zip(again, first))
            moved_same = sum(m == f[half:] for m, f in zip(moved, first))
            moved_share = sum(_agree(m, f[half:]) for m, f in zip(moved, first)) / (
                args.requests * (args.new_tokens - half)
            )
            print(
                f"{dtype:9s} {name:12s} moved: {moved_same}/{args.requests} streams identical, "
                f"{moved_share:.0%} of continued tokens before a difference; "
                f"rerun in another batch: {rerun_same}/{args.requests} identical, "
                f"in chunks of {args.small_chunk}: {sum(c == f for c, f in zip(chunked, first))}/{args.requests}"
            )
        llm.close()
        small.close()


if __name__ == "__main__":
    main()

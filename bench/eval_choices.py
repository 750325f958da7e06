"""Multiple choice as evaluation harnesses send it, with the prefix cache on and off (not a test).

    python bench/eval_choices.py [--questions 8] [--context 400] [--choices 4] [--ending 8]
                                 [--interval 64] [--batch 1] [--threads N] [--model DIR]

Each question is one context (`--context` random tokens) and `--choices` endings (`--ending`
tokens each); every prompt is scored as lm-evaluation-harness's `local-completions` does it:
prompt logprobs (1 alternative) and one new token. Requests go in `--batch` at a time, in question
order (the harness's default batch size is 1). Reports, with the cache on and off: the wall time,
the prompt tokens taken from the cache, and the ratio; and checks that both give the same prompt
logprob entries (token ids and top ids equal, log-probabilities within 1e-4). float32 on the
built-in tiny model unless `--model`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.tiny_model import TinyModelSpec, make_tiny_model  # noqa: E402


def _prompts(args) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(args.questions):
        ctx = torch.randint(0, 1000, (args.context,), generator=g).tolist()
        out += [ctx + torch.randint(0, 1000, (args.ending,), generator=g).tolist() for _ in range(args.choices)]
    return out


def _run(model: str, prompts, args, cache: bool):
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    with LLM(model, dtype="float32", enable_prefix_caching=cache, prefix_snapshot_interval=args.interval) as llm:
        llm.generate(prompt_token_ids=[prompts[0][:32]], sampling_params=sp)  # warm-up (a prefix no prompt shares)
        t0 = time.perf_counter()
        outs = []
        for i in range(0, len(prompts), args.batch):
            outs += llm.generate(prompt_token_ids=prompts[i : i + args.batch], sampling_params=sp)
        wall = time.perf_counter() - t0
    return wall, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument("--choices", type=int, default=4)
    ap.add_argument("--ending", type=int, default=8)
    ap.add_argument("--interval", type=int, default=64, help="--prefix-snapshot-interval")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_tiny_model(Path(tmp) / "tiny", TinyModelSpec(tokenizer=False)))
        _compare(model, args)


def _compare(model: str, args) -> None:
    prompts = _prompts(args)
    total = sum(len(p) for p in prompts)
    res = {}
    for cache in (False, True):
        wall, outs = _run(model, prompts, args, cache)
        hit = sum(o.num_cached_tokens for o in outs)
        res[cache] = (wall, outs)
        print(
            f"cache {'on ' if cache else 'off'}: {wall:.2f} s, {hit} of {total} prompt tokens from the cache ({hit / total:.1%})"
        )
    for a, b in zip(res[True][1], res[False][1]):
        for (ta, la, pa), (tb, lb, pb) in zip(a.prompt_logprobs, b.prompt_logprobs, strict=True):
            assert ta == tb and [i for i, _ in pa] == [i for i, _ in pb] and abs(la - lb) < 1e-4, "entries differ"
    print(f"same prompt logprobs; wall time cache on / off: {res[True][0] / res[False][0]:.2f}x "
          f"({res[False][0] / res[True][0]:.2f}x faster)")  # fmt: skip


if __name__ == "__main__":
    main()

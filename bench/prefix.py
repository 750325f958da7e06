"""Prefix caching in the engine: a multi-turn chat workload with the cache on and off.

    python bench/prefix.py [--conversations 16] [--turns 4] [--system 300] [--user 40] [--reply 16]
                           [--interval 64] [--threads N] [--model DIR]

Every conversation opens with the same system prompt (`--system` tokens); turn t's prompt is the
system prompt, the earlier turns (user message + the model's greedy reply) and a new user
message (`--user` random tokens). A turn's prompts of all conversations go in as one batch, so
the cache can serve the shared system prompt (to requests admitted after the first one's grid
snapshot) and every conversation's previous turn (its end-of-prompt snapshot and pages). Reports,
per setting: prompt tokens taken from the cache (hit rate), TTFT p50 / p99 (engine arrival ->
first token), the wall time of all turns and prompt + output tokens per second; then the ratios
on / off. Greedy float32 on the built-in tiny model unless `--model`; the replies must be the same
with the cache on and off (checked).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.tiny_model import TinyModelSpec, make_tiny_model  # noqa: E402


def workload(args, vocab: int):
    g = torch.Generator().manual_seed(0)

    def rand(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    system = rand(args.system)
    users = [[rand(args.user) for _ in range(args.turns)] for _ in range(args.conversations)]
    return system, users


def run(llm: LLM, system, users, args) -> dict:
    sp = SamplingParams(max_tokens=args.reply, temperature=0.0, ignore_eos=True)
    history = [list(system) for _ in users]
    ttfts, replies, tokens = [], [], 0
    pc = llm.engine.prefix
    q0, h0 = (pc.stats.query_tokens, pc.stats.hit_tokens) if pc else (0, 0)
    t0 = time.perf_counter()
    for t in range(args.turns):
        prompts = [h + u[t] for h, u in zip(history, users)]
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
        for i, o in enumerate(outs):
            ttfts.append(o.metrics["ttft_s"])
            replies.append(o.output_token_ids)
            tokens += len(prompts[i]) + len(o.output_token_ids)
            history[i] = prompts[i] + o.output_token_ids
    wall = time.perf_counter() - t0
    q, h = (pc.stats.query_tokens - q0, pc.stats.hit_tokens - h0) if pc else (1, 0)
    ttfts.sort()
    return dict(
        hit=h / q,
        p50=statistics.median(ttfts),
        p99=ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        wall=wall,
        tps=tokens / wall,
        replies=replies,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=300)
    ap.add_argument("--user", type=int, default=40)
    ap.add_argument("--reply", type=int, default=16)
    ap.add_argument("--interval", type=int, default=64, help="--prefix-snapshot-interval")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or str(make_tiny_model(Path(tmp) / "tiny", TinyModelSpec(tokenizer=False)))
        res = {}
        for on in (False, True):
            with LLM(path, dtype="float32", kv_cache_memory="1GiB", enable_prefix_caching=on,
                     prefix_snapshot_interval=args.interval, prefix_snapshot_memory=0.3) as llm:  # fmt: skip
                system, users = workload(args, llm.config.model.vocab_size)
                res[on] = run(llm, system, users, args)
    if res[True]["replies"] != res[False]["replies"]:
        raise SystemExit("replies differ with the cache on and off")
    for on in (False, True):
        r = res[on]
        print(
            f"cache {'on ' if on else 'off'}: hit rate {r['hit']:.1%}, TTFT p50 {r['p50'] * 1e3:.1f} ms "
            f"p99 {r['p99'] * 1e3:.1f} ms, wall {r['wall']:.2f} s, {r['tps']:.0f} tokens/s"
        )
    on, off = res[True], res[False]
    print(
        f"on / off: TTFT p50 {on['p50'] / off['p50']:.2f}x, p99 {on['p99'] / off['p99']:.2f}x, "
        f"wall {on['wall'] / off['wall']:.2f}x, throughput {on['tps'] / off['tps']:.2f}x (same replies)"
    )


if __name__ == "__main__":
    main()

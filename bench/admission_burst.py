"""Admission under a burst (issue 30; not a test): `up` with 1 prefill + 1 decode node, a warm-up
that measures the prefill node's rate, then N distinct prompts sent at once. Reports how many
completed and how many were refused, how fast the refusals came (and their Retry-After), each
admitted request's wait to start against the budget, the admitted count against what the
prefill pool can start within the budget at its measured rate, and whether every completed
request has the tokens the same prompt gets alone on the idle cluster afterwards. In bfloat16 a
prompt chunked differently (or restored from a prefix snapshot) rounds differently, so a request
whose tokens first differ where the idle cluster's top two logprobs were within `NEAR_TIE` is
counted apart from one that differs elsewhere (which would be a fault).

    python bench/admission_burst.py [--requests 96] [--prompt-len 3000] [--admission-timeout 10]
    python bench/admission_burst.py --priority [--requests 48]   # interactive TTFT under a batch flood
    python bench/admission_burst.py --long-every 10 --long-len 6000   # mixed lengths: one long in ten

With mixed lengths the queue's work is priced at its length-weighted mean prompt (docs/router.md,
"Leases and admission"): `late` counts admitted requests that started after their budget."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _one(c, p, new_tokens, **kw):
    """(token ids or PdserveError, seconds to the answer or refusal, seconds to the first token)."""
    from client import PdserveError

    t0 = time.monotonic()
    try:
        toks, first = [], None
        for ch in c.stream(prompt_token_ids=p, max_tokens=new_tokens, temperature=0.0, ignore_eos=True, **kw):
            first = first or time.monotonic() - t0
            toks += ch.token_ids
        return toks, time.monotonic() - t0, first
    except PdserveError as e:
        return e, time.monotonic() - t0, None


NEAR_TIE = 0.02  # logprob gap between the reference's top two tokens below which a flip is rounding


def _reference(c, p, new_tokens) -> tuple[list[int], list[float]]:
    """The idle cluster's tokens for prompt p, and at each the gap between its top two logprobs."""
    r = c.generate(prompt_token_ids=p, max_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    return list(r.token_ids), [t.top[0][1] - t.top[1][1] if len(t.top) > 1 else float("inf") for t in r.logprobs]


def _near_tie(got: list[int], ref: tuple[list[int], list[float]]) -> bool:
    """got differs from the reference first where the reference's top two were within NEAR_TIE:
    a flip bfloat16 rounding explains (a prompt chunked differently, a prefix restored)."""
    toks, gaps = ref
    j = next((i for i, (a, b) in enumerate(zip(got, toks)) if a != b), None)
    return j is not None and gaps[j] < NEAR_TIE


def _spec(model, budget: float, chunk: int | None = None, dtype: str = "float32"):
    """1 prefill + 1 decode node, room for the whole burst on the decode node; chunk: the nodes'
    --batch-chunk-tokens (None: its default)."""
    from router.launch import PoolSpec

    opts = {"dtype": dtype, "kv_cache_memory": "2GiB", "max_num_seqs": 128}
    return PoolSpec(
        model=str(model),
        prefill=1,
        decode=1,
        port=0,
        log_level=os.environ.get("PDSERVE_BENCH_LOG", "WARNING"),
        node_options=opts if chunk is None else {**opts, "batch_chunk_tokens": chunk},
        router_options={"admission_timeout_s": budget},
    )


def run(model, prompts, warm, new_tokens: int, budget: float, dtype: str = "float32") -> dict:
    from client import Client
    from router.launch import Cluster

    with Cluster(_spec(model, budget, dtype=dtype), out=sys.stderr) as cl:
        cl.start()
        with Client(cl.address, timeout=3600) as c:
            c.wait_ready(timeout=120)
            t0 = time.monotonic()
            for p in warm:  # the router measures the prefill node's rate from these
                c.generate(prompt_token_ids=p, max_tokens=2, temperature=0.0, ignore_eos=True)
            rate = sum(map(len, warm)) / (time.monotonic() - t0)
            with ThreadPoolExecutor(len(prompts)) as ex:
                outs = list(ex.map(lambda p: _one(c, p, new_tokens), prompts))
            done = [i for i, (r, _, _) in enumerate(outs) if isinstance(r, list)]
            alone = {i: _reference(c, prompts[i], new_tokens) for i in done}  # the idle cluster's tokens
    refused = [(r, s) for r, s, _ in outs if not isinstance(r, list)]
    starts = [outs[i][2] for i in done]
    late = sum(s > budget for s in starts) if budget else 0
    return {
        "budget": budget,
        "done": len(done),
        "exact": sum(outs[i][0] == alone[i][0] for i in done),
        "near_tie": sum(outs[i][0] != alone[i][0] and _near_tie(outs[i][0], alone[i]) for i in done),
        "refused": len(refused),
        "codes": sorted({e.code.name for e, _ in refused}),
        "refuse_max_s": max((s for _, s in refused), default=0.0),
        "retry_after": [e.retry_after_s for e, _ in refused],
        "start_max_s": max(starts, default=0.0),
        "late": late,
        "rate": rate,
        # the pool's rate in the burst: the prompts it prefilled over the time to the last first token
        "burst_rate": sum(len(prompts[i]) for i in done) / max(starts, default=1.0),
    }


def run_priority(
    model, prompts, probes, warm, new_tokens: int, chunk: int | None, dtype: str = "float32"
) -> tuple[list[float], list[float]]:
    """Interactive TTFTs, one probe at a time: a third of `probes` on the idle cluster, a third
    under a batch-class flood of `prompts` (no budget: all wait their turn; a probe every 0.25 s
    from 2 s in), the last third on the idle cluster after the flood (idle: before and after, so
    a load that drifts meanwhile weighs on both sides)."""
    from client import Client
    from router.launch import Cluster

    with Cluster(_spec(model, 0.0, chunk, dtype), out=sys.stderr) as cl:
        cl.start()
        with Client(cl.address, timeout=3600) as c:
            c.wait_ready(timeout=120)
            for p in warm:
                c.generate(prompt_token_ids=p, max_tokens=2, temperature=0.0, ignore_eos=True)
            k = len(probes) // 3
            idle = [_one(c, p, new_tokens)[2] for p in probes[:k]]
            with ThreadPoolExecutor(len(prompts)) as ex:
                flood = [ex.submit(_one, c, p, new_tokens, priority="batch") for p in prompts]
                time.sleep(2.0)
                loaded = []
                for p in probes[k : 2 * k]:
                    loaded.append(_one(c, p, new_tokens)[2])
                    time.sleep(0.25)
                [f.result() for f in flood]
            idle += [_one(c, p, new_tokens)[2] for p in probes[2 * k :]]
    return idle, loaded


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint (default: the built-in tiny model)")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--prompt-len", type=int, default=3000)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument(
        "--admission-timeout", type=float, action="append", help="budget(s), seconds, in order (default: 0 then 10)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--long-every", type=int, default=0, help="every Nth burst prompt is long (0: none)")
    ap.add_argument("--long-len", type=int, default=6000, help="--long-every: the long prompts' tokens")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the nodes' dtype")
    ap.add_argument("--priority", action="store_true", help="interactive TTFT, idle vs under a batch flood")
    ap.add_argument("--probe-len", type=int, default=500, help="--priority: interactive prompt tokens")
    ap.add_argument("--probes", type=int, default=12, help="--priority: probes per phase (idle, flood, idle again)")
    ap.add_argument(
        "--batch-chunk-tokens", type=int, default=None, help="--priority: the nodes' option (default theirs)"
    )
    args = ap.parse_args()

    import torch

    from router.cli import default_model_dir

    model = Path(args.model) if args.model else default_model_dir()
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(1, 1000, (args.requests + 2, args.prompt_len), generator=g).tolist()
    if args.long_every:  # after the two warm-up prompts
        for i in range(2, len(prompts), args.long_every):
            prompts[i] = torch.randint(1, 1000, (args.long_len,), generator=g).tolist()
    mix = f", one in {args.long_every} of {args.long_len}" if args.long_every else ""
    print(f"{args.requests} distinct prompts of {args.prompt_len} tokens{mix} at once, 1P+1D; model {model}")
    if args.priority:
        probes = torch.randint(1, 1000, (3 * args.probes, args.probe_len), generator=g).tolist()
        idle, loaded = run_priority(
            model, prompts[2:], probes, prompts[:2], args.new_tokens, args.batch_chunk_tokens, args.dtype
        )
        p50 = statistics.median
        print(
            f"interactive {args.probe_len}-token prompts, one at a time: TTFT p50 {p50(idle) * 1e3:.0f} ms idle, "
            f"{p50(loaded) * 1e3:.0f} ms under the batch flood ({p50(loaded) / p50(idle):.2f}x); "
            f"max {max(idle) * 1e3:.0f} / {max(loaded) * 1e3:.0f} ms"
        )
        return 0
    rate = None  # the pool's rate in a burst with no budget: what "can start within a budget" is measured by
    for budget in args.admission_timeout or [0.0, 10.0]:
        m = run(model, prompts[2:], prompts[:2], args.new_tokens, budget, args.dtype)
        if not budget:
            rate = m["burst_rate"]
        mean = statistics.mean(map(len, prompts[2:]))
        can = budget * (rate or m["rate"]) / mean if budget else args.requests
        m["can_start"] = min(can, args.requests)  # a budget that fits the whole burst admits all of it
        ra = [x for x in m["retry_after"] if x is not None]
        print(
            f"--admission-timeout {budget:g}: {m['done']} completed ({m['exact']} with the idle cluster's tokens"
            + (f", {m['near_tie']} first differ at a near-tie" if m["near_tie"] else "")
            + f", {m['done'] - m['exact'] - m['near_tie']} other), "
            f"{m['refused']} refused {m['codes']} within {m['refuse_max_s'] * 1e3:.0f} ms of being sent"
            + (f" (Retry-After {min(ra):.1f}-{max(ra):.1f} s)" if ra else "")
            + f"; admitted ones started within {m['start_max_s']:.1f} s ({m['late']} after the budget); rate {m['rate']:,.0f} tokens/s warm-up, "
            f"{m['burst_rate']:,.0f} in the burst: {m['can_start']:.1f} prompts can start in the budget, {m['done'] / max(m['can_start'], 1e-9):.0%} admitted"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

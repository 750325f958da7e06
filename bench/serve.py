"""Serving benchmark (not a test): the tiny model disaggregated, colocated, as the offline engine
and as transformers' generate (TTFT, TPOT, throughput, served / offline, and where each served
run's CPU went: router, nodes with their rank processes, client); `--overload` measures goodput,
p99 TTFT and failures by code at twice and four times the load the pools sustain.

    python bench/serve.py [--overload] [--requests 64] [--prompt-len 512] [--new-tokens 64] [--concurrency 16]
    python bench/serve.py --configs colocated offline --rounds 3 [--dtype bfloat16] [--node-option worker_process=false] [--no-token-streams]"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the nodes run, before torch loads


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


CLIENT_OPTIONS: dict = {"token_streams": True}  # the SDK's (client/mux.py); main() sets --no-token-streams
NODE_OPTIONS: dict = {"dtype": "float32", "kv_cache_memory": "512MiB"}  # main() adds --dtype, --node-option


@contextlib.contextmanager
def cluster_client(model, prompts, prefill: int, **router_options):
    """`up` with one decode node (and `prefill` prefill nodes), warmed up; yields (Client, Cluster)."""
    from client import Client
    from router.launch import Cluster, PoolSpec

    spec = PoolSpec(
        model=str(model),
        prefill=prefill,
        decode=1,
        port=0,
        log_level="WARNING",
        node_options=dict(NODE_OPTIONS),
        router_options=router_options,
    )
    with Cluster(spec, out=sys.stderr) as cl:
        cl.start()
        with Client(cl.address, timeout=600, **CLIENT_OPTIONS) as c:
            c.wait_ready(timeout=60)
            for p in prompts[:2]:  # warm-up
                c.generate(prompt_token_ids=p, max_tokens=4, temperature=0.0, ignore_eos=True)
            yield c, cl


def cpu_now(cl) -> dict[str, float]:
    """CPU seconds so far: every component (a node with its rank processes) and this process (the client)."""
    from bench.proc_cpu import self_cpu_s, tree_cpu_s

    return {**{name: tree_cpu_s(p.pid) for name, p in cl.procs.items()}, "client": self_cpu_s()}


def run_cluster(model, prompts, new_tokens, conc, prefill: int) -> tuple[dict, list[list[int]]]:
    with cluster_client(model, prompts, prefill) as (c, cl):

        def one(p):
            return c.generate(prompt_token_ids=p, max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

        cpu0 = cpu_now(cl)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(conc) as ex:
            rs = list(ex.map(one, prompts))
        wall = time.perf_counter() - t0
        cpu = {k: v - cpu0[k] for k, v in cpu_now(cl).items()}
    assert all(len(r.token_ids) == new_tokens for r in rs)
    if prefill:
        assert all(r.prefill_node for r in rs), "a request skipped the prefill pool"
    m = {
        "ttft": [r.ttft_s for r in rs],
        "tpot": [r.tpot_s for r in rs],
        "tput": len(rs) * new_tokens / wall,
        "wall": wall,
        "xfer_ms": statistics.mean(r.transfer_s for r in rs) * 1e3,
        "xfer_kib": statistics.mean(r.transfer_bytes for r in rs) / 1024,
        "cpu": cpu,
    }
    return m, [r.token_ids for r in rs]


def _one(c, p, new_tokens):
    from client import PdserveError

    try:
        return c.generate(prompt_token_ids=p, max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    except PdserveError as e:
        return e


def run_overload(model, prompts, new_tokens, conc, prefill: int, admission_timeout: float, slo: float) -> list[dict]:
    """Sustained load (closed loop), then open-loop arrivals at 2x and 4x it, on one cluster."""
    rows = []
    with cluster_client(model, prompts, prefill, admission_timeout_s=admission_timeout) as (c, _):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(conc) as ex:
            base = list(ex.map(lambda p: _one(c, p, new_tokens), prompts))
        wall = time.perf_counter() - t0
        rate = sum(1 for r in base if not isinstance(r, Exception)) / wall
        rows.append(_load_row("1x (closed loop)", base, base, wall, rate, slo))
        for mult in (2, 4):
            gap = 1.0 / (mult * rate)
            with ThreadPoolExecutor(len(prompts)) as ex:
                t0 = time.perf_counter()
                futs = []
                for i, p in enumerate(prompts):
                    time.sleep(max(0.0, t0 + i * gap - time.perf_counter()))
                    futs.append(ex.submit(_one, c, p, new_tokens))
                rs = [f.result() for f in futs]
            wall = time.perf_counter() - t0
            rows.append(_load_row(f"{mult}x ({mult * rate:.2f} req/s)", rs, base, wall, mult * rate, slo))
    return rows


def _load_row(name, rs, base, wall, rate, slo) -> dict:
    ok = [(r, b) for r, b in zip(rs, base) if not isinstance(r, Exception)]
    failed = Counter(r.code.name for r in rs if isinstance(r, Exception))
    ttft = [r.ttft_s for r, _ in ok] or [float("nan")]
    return {
        "load": name,
        "offered": rate,
        "done": len(ok) / wall,
        "goodput": sum(r.ttft_s <= slo for r, _ in ok) / wall,
        "ttft50": pct(ttft, 50),
        "ttft99": pct(ttft, 99),
        "n": len(rs),
        "ok": len(ok),
        "failed": dict(failed),
        "same": sum(not isinstance(b, Exception) and r.token_ids == b.token_ids for r, b in ok),
    }


def overload_main(args, model, prompts) -> int:
    out = {}
    for name, prefill in (("disaggregated 1P+1D", 1), ("colocated 1D", 0)):
        print(f"running {name} (overload) ...", file=sys.stderr, flush=True)
        out[name] = run_overload(
            model, prompts, args.new_tokens, args.concurrency, prefill, args.admission_timeout, args.ttft_slo
        )
    print(
        f"\noverload: {args.requests} requests per load, {args.prompt_len}-token prompts, {args.new_tokens} new "
        f"tokens; sustained load measured at concurrency {args.concurrency}; admission timeout "
        f"{args.admission_timeout:g} s; goodput = completed with TTFT <= {args.ttft_slo:g} s, per s; model {model}\n"
    )
    hdr = (
        f"{'config':<22}{'load':<22}{'goodput/s':>10}{'done/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'ok':>5}{'=1x':>5}  failed by code"
    )
    print(hdr)
    print("-" * (len(hdr) + 24))
    for name, rows in out.items():
        for m in rows:
            failed = ", ".join(f"{k} {v}" for k, v in sorted(m["failed"].items())) or "-"
            print(
                f"{name:<22}{m['load']:<22}{m['goodput']:>10.2f}{m['done']:>8.2f}{m['ttft50']:>9.2f}s"
                f"{m['ttft99']:>9.2f}s{m['ok']:>5}{m['same']:>5}  {failed}"
            )
    print("\n=1x: completed requests whose tokens equal the closed-loop run's")
    return 0


def run_offline(model, prompts, new_tokens, conc) -> tuple[dict, list[list[int]]]:
    """The engine the nodes run, in this process, at the same concurrency: what serving could reach
    (issue: served colocated throughput >= 0.8x this). No per-request TTFT or TPOT."""
    from bench.proc_cpu import self_cpu_s
    from engine import LLM, SamplingParams

    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    with LLM(str(model), max_num_seqs=conc, dtype=NODE_OPTIONS["dtype"]) as llm:
        llm.generate(prompt_token_ids=[p[:8] for p in prompts[:2]], sampling_params=SamplingParams(max_tokens=2))
        cpu0 = self_cpu_s()
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
        wall = time.perf_counter() - t0
        cpu = {"engine": self_cpu_s() - cpu0}
    m = {
        "ttft": [],
        "tpot": [],
        "tput": len(prompts) * new_tokens / wall,
        "wall": wall,
        "xfer_ms": 0.0,
        "xfer_kib": 0.0,
        "cpu": cpu,
    }
    return m, [o.output_token_ids for o in outs]


def run_transformers(model, prompts, new_tokens, conc) -> tuple[dict, list[list[int]]]:
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList, Qwen3_5ForCausalLM

    class Stamp(LogitsProcessor):
        def __init__(self):
            self.t: list[float] = []

        def __call__(self, input_ids, scores):
            self.t.append(time.perf_counter())
            return scores

    hf = Qwen3_5ForCausalLM.from_pretrained(str(model), dtype=getattr(torch, NODE_OPTIONS["dtype"])).eval()
    ttft, tpot, toks = [], [], []
    t_all = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), conc):
            ids = torch.tensor(prompts[i : i + conc])
            st = Stamp()
            t0 = time.perf_counter()
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                logits_processor=LogitsProcessorList([st]),
            )
            toks += out[:, ids.shape[1] :].tolist()
            t_first = st.t[0] - t0
            step = (st.t[-1] - st.t[0]) / max(1, len(st.t) - 1)
            ttft += [t_first] * len(ids)
            tpot += [step] * len(ids)
    wall = time.perf_counter() - t_all
    tput = len(prompts) * new_tokens / wall
    return {"ttft": ttft, "tpot": tpot, "tput": tput, "wall": wall, "xfer_ms": 0.0, "xfer_kib": 0.0}, toks


CONFIGS = {  # --configs name -> row title
    "disaggregated": "disaggregated 1P+1D",
    "colocated": "colocated 1D",
    "offline": "offline engine",
    "transformers": "transformers generate",
}


def node_option(text: str) -> tuple[str, object]:
    """KEY=VALUE of --node-option: true/false, a number, or text."""
    k, _, v = text.partition("=")
    low = v.lower()
    val: object = low == "true" if low in ("true", "false") else v
    with contextlib.suppress(ValueError):
        val = float(v) if "." in v else int(v)
    return k.replace("-", "_"), val


def run_one(key: str, model, prompts, args) -> tuple[dict, list[list[int]]]:
    new, conc = args.new_tokens, args.concurrency
    if key in ("disaggregated", "colocated"):
        return run_cluster(model, prompts, new, conc, prefill=int(key == "disaggregated"))
    if key == "offline":
        return run_offline(model, prompts, new, conc)
    return run_transformers(model, prompts, new, conc)


def print_rows(rows: dict, same: dict, args, ref: str) -> None:
    hdr = (
        f"{'config':<24}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}{'tok/s':>9}"
        f"{'wall s':>8}{'xfer ms':>9}{'xfer KiB':>10}{'=' + ref:>9}"
    )
    print(hdr)
    print("-" * len(hdr))
    for n, m in rows.items():
        lat = (
            f"{pct(m['ttft'], 50) * 1e3:>8.1f}ms{pct(m['ttft'], 99) * 1e3:>8.1f}ms"
            f"{pct(m['tpot'], 50) * 1e3:>8.1f}ms{pct(m['tpot'], 99) * 1e3:>8.1f}ms"
            if m["ttft"]
            else f"{'-':>10}" * 4
        )
        print(
            f"{n:<24}{lat}{m['tput']:>9.1f}"
            f"{m['wall']:>8.2f}{m['xfer_ms']:>9.2f}{m['xfer_kib']:>10.0f}{same[n]:>6}/{args.requests}"
        )


def print_cpu(rows: dict, tokens: int) -> None:
    """Each run's CPU per generated token, by process (a node with its rank processes)."""
    print(f"\nCPU per generated token (us; {tokens} tokens a run; a node counts its rank processes):")
    for n, m in rows.items():
        if "cpu" in m:
            parts = ", ".join(f"{k} {v / tokens * 1e6:.0f}" for k, v in m["cpu"].items())
            print(f"  {n:<24}{parts}; total {sum(m['cpu'].values()) / tokens * 1e6:.0f}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint (default: the built-in tiny model)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overload", action="store_true", help="goodput and failures at 2x and 4x the sustained load")
    ap.add_argument("--admission-timeout", type=float, default=30.0, help="--overload: the router's admission wait")
    ap.add_argument("--ttft-slo", type=float, default=10.0, help="--overload: TTFT that counts toward goodput (s)")
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS), help="what runs, in order")
    ap.add_argument("--rounds", type=int, default=1, help="run the configs this many times, alternated")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--no-token-streams", action="store_true", help="the SDK client streams every request on its own call"
    )
    ap.add_argument(
        "--node-option", action="append", default=[], metavar="KEY=VALUE", help="a node option for `up` (repeatable)"
    )
    args = ap.parse_args()
    NODE_OPTIONS.update(dtype=args.dtype, **dict(node_option(o) for o in args.node_option))
    CLIENT_OPTIONS["token_streams"] = not args.no_token_streams

    import torch

    from router.cli import default_model_dir

    model = Path(args.model) if args.model else default_model_dir()
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(1, 1000, (args.requests, args.prompt_len), generator=g).tolist()
    if args.overload:
        return overload_main(args, model, prompts)
    print(
        f"{args.requests} requests, {args.prompt_len}-token prompts, {args.new_tokens} new tokens, "
        f"{args.concurrency} concurrent; {args.dtype}; node options {NODE_OPTIONS}; model {model}",
        file=sys.stderr,
    )
    rounds = []
    for r in range(args.rounds):
        rows, toks = {}, {}
        for key in args.configs:
            print(f"round {r + 1}: running {CONFIGS[key]} ...", file=sys.stderr, flush=True)
            rows[CONFIGS[key]], toks[CONFIGS[key]] = run_one(key, model, prompts, args)
        rounds.append(rows)
        ref = "transformers generate" if "transformers generate" in toks else next(iter(toks))
        same = {n: sum(a == b for a, b in zip(t, toks[ref])) for n, t in toks.items()}
        print(f"\nround {r + 1} of {args.rounds}:\n")
        print_rows(rows, same, args, "HF" if ref == "transformers generate" else ref.split()[0])
        print_cpu(rows, args.requests * args.new_tokens)
    off = [rows["offline engine"]["tput"] for rows in rounds if "offline engine" in rows]
    for name in ("colocated 1D", "disaggregated 1P+1D"):
        got = [rows[name]["tput"] / rows["offline engine"]["tput"] for rows in rounds if name in rows and off]
        if got:
            print(f"\nserved / offline engine throughput, {name}, each round: {', '.join(f'{x:.2f}' for x in got)}")
    last = rounds[-1]
    if all(n in last for n in ("disaggregated 1P+1D", "colocated 1D", "transformers generate")):
        a, b, c = last["disaggregated 1P+1D"], last["colocated 1D"], last["transformers generate"]
        print(
            f"\nthroughput: disaggregated / colocated = {a['tput'] / b['tput']:.2f}, "
            f"disaggregated / transformers = {a['tput'] / c['tput']:.2f}, colocated / transformers = "
            f"{b['tput'] / c['tput']:.2f}"
        )
        print(
            f"TTFT p50: disaggregated / colocated = {pct(a['ttft'], 50) / pct(b['ttft'], 50):.2f}; "
            f"TPOT p50: disaggregated / colocated = {pct(a['tpot'], 50) / pct(b['tpot'], 50):.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

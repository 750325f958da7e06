"""Serving benchmark (not a test): the tiny model disaggregated, colocated, and as transformers'
generate (TTFT, TPOT, throughput); `--overload` measures goodput, p99 TTFT and failures by code
at twice and four times the load the pools sustain.

    python bench/serve.py [--overload] [--requests 64] [--prompt-len 512] [--new-tokens 64] [--concurrency 16]"""

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


@contextlib.contextmanager
def cluster_client(model, prompts, prefill: int, **router_options):
    """`up` with one decode node (and `prefill` prefill nodes), warmed up; yields a Client."""
    from client import Client
    from router.launch import Cluster, PoolSpec

    spec = PoolSpec(
        model=str(model),
        prefill=prefill,
        decode=1,
        port=0,
        log_level="WARNING",
        node_options={"dtype": "float32", "kv_cache_memory": "512MiB"},
        router_options=router_options,
    )
    with Cluster(spec, out=sys.stderr) as cl:
        cl.start()
        with Client(cl.address, timeout=600) as c:
            c.wait_ready(timeout=60)
            for p in prompts[:2]:  # warm-up
                c.generate(prompt_token_ids=p, max_tokens=4, temperature=0.0, ignore_eos=True)
            yield c


def run_cluster(model, prompts, new_tokens, conc, prefill: int) -> tuple[dict, list[list[int]]]:
    with cluster_client(model, prompts, prefill) as c:

        def one(p):
            return c.generate(prompt_token_ids=p, max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(conc) as ex:
            rs = list(ex.map(one, prompts))
        wall = time.perf_counter() - t0
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
    with cluster_client(model, prompts, prefill, admission_timeout_s=admission_timeout) as c:
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
    from engine import LLM, SamplingParams

    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    with LLM(str(model), max_num_seqs=conc) as llm:
        llm.generate(prompt_token_ids=[p[:8] for p in prompts[:2]], sampling_params=SamplingParams(max_tokens=2))
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
        wall = time.perf_counter() - t0
    m = {
        "ttft": [],
        "tpot": [],
        "tput": len(prompts) * new_tokens / wall,
        "wall": wall,
        "xfer_ms": 0.0,
        "xfer_kib": 0.0,
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

    hf = Qwen3_5ForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
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
    args = ap.parse_args()

    import torch

    from router.cli import default_model_dir

    model = Path(args.model) if args.model else default_model_dir()
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(1, 1000, (args.requests, args.prompt_len), generator=g).tolist()
    if args.overload:
        return overload_main(args, model, prompts)
    rows = {}
    toks = {}
    for name, fn in [
        ("disaggregated 1P+1D", lambda: run_cluster(model, prompts, args.new_tokens, args.concurrency, prefill=1)),
        ("colocated 1D", lambda: run_cluster(model, prompts, args.new_tokens, args.concurrency, prefill=0)),
        ("offline engine", lambda: run_offline(model, prompts, args.new_tokens, args.concurrency)),
        ("transformers generate", lambda: run_transformers(model, prompts, args.new_tokens, args.concurrency)),
    ]:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        rows[name], toks[name] = fn()
    same = {n: sum(a == b for a, b in zip(t, toks["transformers generate"])) for n, t in toks.items()}
    print(
        f"\n{args.requests} requests, {args.prompt_len}-token prompts, {args.new_tokens} new tokens, "
        f"{args.concurrency} concurrent; model {model}\n"
    )
    hdr = (
        f"{'config':<24}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}{'tok/s':>9}"
        f"{'wall s':>8}{'xfer ms':>9}{'xfer KiB':>10}{'=HF':>7}"
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
            f"{m['wall']:>8.2f}{m['xfer_ms']:>9.2f}{m['xfer_kib']:>10.0f}{same[n]:>4}/{args.requests}"
        )
    a, b, c = rows["disaggregated 1P+1D"], rows["colocated 1D"], rows["transformers generate"]
    off = rows["offline engine"]["tput"]
    print(f"\nserved / offline engine throughput: colocated {b['tput'] / off:.2f}, disaggregated {a['tput'] / off:.2f}")
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

"""The short CUDA benchmark of tools/gpu_check.sh (not a test).

GDN prefill and paged attention at Qwen3.5-35B-A3B's sizes (against fla where installed), its
routed-experts block (achieved bandwidth against the GPU's), the batched sampler at batch 64 over Qwen's 151,936-token vocabulary, the engine's decode step at
batch 1 and 64 (wall time and the GPU's kernel time per step), and a NIXL VRAM transfer. Without
a CUDA device it says so and exits 0.

    python bench/gpu_check.py [--json OUT.json] [--reps 3]"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.timing import call_times  # noqa: E402

HK, HV, DK, DV = 16, 32, 128, 128


def _ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100)


def _wall_us(call, n: int = 200) -> tuple[float, float, float]:
    """(median, min, max) microseconds of single calls that end in a host read."""
    ts = call_times(call, n, warmup=10)
    return statistics.median(ts) * 1e6, min(ts) * 1e6, max(ts) * 1e6


def _graphed_ms(fn) -> float:
    """fn's time replayed from a CUDA graph: the GPU's time without the host's launches, which
    bound a small call run eagerly."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiled and warmed outside the capture
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return _ms(g.replay)


def gdn_prefill(results: dict) -> None:
    from kernels.gdn import l2norm
    from kernels.triton.gdn_chunk import gdn_chunk_prefill_triton

    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # not installed, or built for another torch / triton
        print(f"flash-linear-attention unavailable: {type(e).__name__}: {e}", flush=True)
        chunk_gated_delta_rule = None
    dt, dev = torch.bfloat16, "cuda"
    for B, T in ((1, 4096), (4, 4096), (16, 256), (64, 128)):
        gen = torch.Generator().manual_seed(B)
        N = B * T
        q = l2norm(torch.randn(N, HK, DK, generator=gen)).to(dt).to(dev)
        k = l2norm(torch.randn(N, HK, DK, generator=gen)).to(dt).to(dev)
        v = torch.randn(N, HV, DV, generator=gen).to(dt).to(dev)
        g = (-F.softplus(torch.randn(N, HV, generator=gen) - 1.0)).to(dev)
        beta = torch.sigmoid(torch.randn(N, HV, generator=gen)).to(dev)
        cu = (torch.arange(B + 1, dtype=torch.int64) * T).to(dev)
        pool = torch.zeros(B, HV, DK, DV, device=dev)
        slots = torch.arange(B, device=dev)
        ours = _ms(lambda: gdn_chunk_prefill_triton(q, k, v, g, beta, cu, pool, slots))
        row = {"batch": B, "tokens": T, "ours_ms": ours}
        line = f"GDN chunked prefill {B} x {T} tokens: ours {ours:.3f} ms"
        if chunk_gated_delta_rule is None:
            line += " (flash-linear-attention not installed: no comparison)"
        else:
            try:
                rep = HV // HK  # value heads per key head, expanded for fla
                qe, ke = q.repeat_interleave(rep, 1)[None], k.repeat_interleave(rep, 1)[None]
                init = torch.zeros(B, HV, DK, DV, device=dev)
                theirs = _ms(
                    lambda: chunk_gated_delta_rule(
                        qe,
                        ke,
                        v[None],
                        g[None],
                        beta[None].to(dt),
                        initial_state=init,
                        output_final_state=True,
                        cu_seqlens=cu,
                    )
                )
                row.update(fla_ms=theirs, ratio_fla_over_ours=theirs / ours)
                line += f", fla {theirs:.3f} ms, ratio fla/ours {theirs / ours:.2f}"
            except Exception as e:  # fla's API moves between releases; report it, keep the rest
                row["fla_error"] = f"{type(e).__name__}: {e}"
                line += f" (fla comparison failed: {row['fla_error']})"
        print(line, flush=True)
        results.setdefault("gdn_prefill", []).append(row)
    from kernels import fla_gdn

    picked = "fla" if fla_gdn.usable(q, None) else "pdserve"
    print(f"GDN prefill in the engine: {picked} (PDSERVE_GDN_PREFILL={fla_gdn.choice()})", flush=True)
    results["gdn_prefill_engine"] = picked


def paged_attention(results: dict) -> None:
    from kernels.triton.paged_attention import paged_attention_triton

    H, KVH, HD, BS = 16, 2, 256, 16
    dt, dev = torch.bfloat16, "cuda"
    cases = {
        "decode b64, context 150": [(1, 150)] * 64,
        "decode b64, context 4096": [(1, 4096)] * 64,
        "verify b64 x 4 tokens, context 2048": [(4, 2048)] * 64,
        "prefill 4096": [(4096, 4096)],
    }
    for name, rows in cases.items():
        gen = torch.Generator().manual_seed(len(rows))
        pages = [-(-ctx // BS) for _, ctx in rows]
        pool = torch.randn(sum(pages) + 1, 2, KVH, BS, HD, generator=gen).to(dt).to(dev)
        perm = 1 + torch.randperm(sum(pages), generator=gen)
        tables = torch.zeros(len(rows), max(pages), dtype=torch.int32)
        i = 0
        for b, n in enumerate(pages):
            tables[b, :n] = perm[i : i + n].int()
            i += n
        q = torch.randn(sum(n for n, _ in rows), H, HD, generator=gen).to(dt).to(dev)
        cu = torch.tensor([0] + [n for n, _ in rows], dtype=torch.int64).cumsum(0).to(dev)
        seq_lens = torch.tensor([c for _, c in rows], dtype=torch.int64).to(dev)
        tables = tables.to(dev)
        t = _ms(lambda: paged_attention_triton(q, pool, cu, seq_lens, tables, HD**-0.5))
        print(f"paged attention {name}: {t * 1e3:.1f} us", flush=True)
        results.setdefault("paged_attention", []).append({"case": name, "us": t * 1e3})


HBM_GBS = {"H100": 3350.0, "H200": 4800.0}  # the data sheets' memory bandwidth, GB/s


def moe_block(results: dict) -> None:
    """The routed experts of one Qwen3.5-35B-A3B layer (256 experts of 2048 -> 2 x 512 -> 2048, 8
    a token) through the engine's fused MoE, bfloat16 and block-FP8: time, the bytes of the
    experts the batch touches (each read once) and the bandwidth that makes, against the GPU's;
    eager (host launches included: they bound a few tokens) and replayed from a CUDA graph, as
    the engine's decode step runs."""
    from kernels.fp8 import quant_fp8_block
    from kernels.moe import select_experts
    from kernels.triton.moe import fused_moe_triton

    E, H, I, K = 256, 2048, 512, 8
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    q13, s13 = quant_fp8_block(w13, (128, 128))
    q2, s2 = quant_fp8_block(w2, (128, 128))
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in HBM_GBS.items() if k in name), float("nan"))
    for T in (1, 16, 64, 256):
        x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
        wts, ids = select_experts(torch.randn(T, E, device="cuda", generator=gen), K, True)
        used = int(torch.unique(ids).numel())
        for kind, args, wbytes in (
            ("bf16", (w13, w2, wts, ids), 2),
            ("fp8", (q13, q2, wts, ids, s13, s2, (128, 128)), 1),
        ):
            nbytes = used * 3 * I * H * wbytes
            row = {"kind": kind, "tokens": T, "experts": used, "bytes": nbytes}
            line = f"MoE block {kind}, {T} tokens ({used} experts touched, {nbytes / 1e6:.0f} MB of them):"
            for how, timer in (("eager", _ms), ("graphed", _graphed_ms)):
                try:
                    t = timer(lambda args=args: fused_moe_triton(x, *args))
                except Exception as e:  # a capture the kernels' host code does not allow: say so, go on
                    line += f" {how} failed ({type(e).__name__}: {e})"
                    continue
                gbs = nbytes / (t * 1e-3) / 1e9
                row.update({f"{how}_us": t * 1e3, f"{how}_gbs": gbs, f"{how}_of_peak": gbs / peak})
                line += f" {how} {t * 1e3:.1f} us, {gbs:.0f} GB/s ({gbs / peak:.0%} of {peak:.0f});"
            print(line, flush=True)
            results.setdefault("moe", []).append(row)


def sampler(results: dict) -> None:
    """One sampler call over 64 rows of 151,936 float32 logits, wall time including the call's one
    host read: greedy; Qwen's chat settings (temperature 0.7, top-p 0.8, top-k 20, presence
    penalty 1.5, a seed per row) on new requests (their penalty tables built each call) and on
    running ones (each call advances every row by its token, the host loop included), eager and
    with the plan's device work replayed from its CUDA graph (each call first copies the logits into
    one buffer, as a decode graph's output sits at one address); top-p alone;
    and the two device ops of top-p alone (the 1024-token head and the row's logsumexp)."""
    from engine.sampling import Sampler
    from engine.sampling_params import SamplingParams
    from engine.step import RowInput

    B, V = 64, 151_936
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(B, V, device="cuda", generator=gen) * 4
    chat = dict(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5)
    cases = {
        "greedy": [SamplingParams(temperature=0.0) for _ in range(B)],
        "qwen chat, seeded": [SamplingParams(**chat, seed=1000 + b) for b in range(B)],
        "qwen chat, seeded, running rows": [SamplingParams(**chat, seed=1000 + b) for b in range(B)],
        "qwen chat, seeded, running rows, graphed": [SamplingParams(**chat, seed=1000 + b) for b in range(B)],
        "top-p 0.95 only, seeded": [SamplingParams(temperature=0.8, top_p=0.95, seed=b) for b in range(B)],
    }
    first = list(range(B))
    for name, params in cases.items():
        s = Sampler(device="cuda")
        rows = [
            RowInput(
                f"r{b}", [7], 40, 0, [], True, True, params=p, num_draft=0, history=(list(range(40)), []), num_output=0
            )
            for b, p in enumerate(params)
        ]
        if "running rows" in name:
            work = torch.empty_like(logits)  # one address, as a decode graph's logits: `static`
            static = name.endswith("graphed")

            def call(s=s, rows=rows, work=work, static=static):
                work.copy_(logits)
                emitted, _ = s(work, rows, first, static=static)
                for r, toks in zip(rows, emitted):
                    r.history[1].append(toks[0])
                    r.num_output += 1

        else:

            def call(s=s, rows=rows):
                s(logits.clone(), rows, first)

        if "running rows" in name:  # a call reuses the last one's plan: single calls, wall clock
            med, lo, hi = _wall_us(call)
            print(f"sampler batch {B}, vocab {V}, {name}: {med:.0f} us a call (wall median; {lo:.0f}-{hi:.0f})")
            results.setdefault("sampler", []).append({"case": name, "batch": B, "vocab": V, "us": med, "wall": True})
            continue
        t = _ms(call)
        print(f"sampler batch {B}, vocab {V}, {name}: {t * 1e3:.0f} us a call", flush=True)
        results.setdefault("sampler", []).append({"case": name, "batch": B, "vocab": V, "us": t * 1e3})
    from kernels.triton.topk import topk_triton

    parts = {
        "clone of the logits": lambda: logits.clone(),
        "torch.topk 20": lambda: torch.topk(logits, 20, dim=-1),
        "kernels/triton/topk.py 20": lambda: topk_triton(logits, 20),
        "kernels/triton/topk.py 20, blocks of 1024": lambda: topk_triton(logits, 20, block=1024),
        "kernels/triton/topk.py 20, blocks of 4096": lambda: topk_triton(logits, 20, block=4096),
        "kernels/triton/topk.py 20, every block": lambda: topk_triton(logits, 20, prune=False),
        "kernels/triton/topk.py 20, every block, 4 warps": lambda: topk_triton(logits, 20, warps=4, prune=False),
        "torch.topk 1024": lambda: torch.topk(logits, 1024, dim=-1),
        "logsumexp": lambda: torch.logsumexp(logits / 0.8, dim=-1),
    }
    for name, fn in parts.items():
        t = _ms(fn)
        print(f"sampler part, batch {B}, vocab {V}, {name}: {t * 1e3:.0f} us", flush=True)
        results.setdefault("sampler_parts", []).append({"op": name, "us": t * 1e3})


def decode_steps(results: dict, reps: int, device: str = "cuda") -> None:
    from engine import LLM
    from engine.tiny_model import TinyModelSpec, make_tiny_model

    spec = TinyModelSpec(
        layers=4,
        hidden=2048,
        intermediate=1024,
        heads=16,
        kv_heads=2,
        head_dim=256,
        linear_key_heads=HK,
        linear_value_heads=HV,
        linear_key_head_dim=DK,
        linear_value_head_dim=DV,
        vocab=4096,
        dtype="bfloat16",
        tokenizer=False,
        seed=0,
    )
    steps = 10 * reps
    modes = {}
    with tempfile.TemporaryDirectory() as d:
        path = str(make_tiny_model(Path(d) / "ckpt", spec))
        for mode in ("graphs", "eager"):
            os.environ["PDSERVE_CUDA_GRAPHS"] = "1" if mode == "graphs" else "0"
            with LLM(path, dtype="bfloat16", device=device, kv_cache_memory="4GiB", max_num_seqs=64) as llm:
                times, gpu = {}, {}
                for B in (1, 64):
                    times[B], gpu[B] = _decode_step_ms(llm, B, steps)
                w = llm.engine.executor.worker
                replays = w.graphs.replays if getattr(w, "graphs", None) is not None else 0
            os.environ.pop("PDSERVE_CUDA_GRAPHS", None)
            ratio = 64 * times[1] / times[64]
            print(
                f"decode step, {mode} (4 layers at model sizes, bf16): batch 1 {times[1]:.2f} ms "
                f"(GPU kernels {gpu[1]:.2f} ms), batch 64 {times[64]:.2f} ms (GPU kernels {gpu[64]:.2f} ms), "
                f"throughput ratio 64*t1/t64 {ratio:.1f}, graph replays {replays}",
                flush=True,
            )
            modes[mode] = {
                "batch1_ms": times[1],
                "batch64_ms": times[64],
                "batch1_gpu_ms": gpu[1],
                "batch64_gpu_ms": gpu[64],
                "ratio_throughput_64_over_1": ratio,
                "replays": replays,
            }
    results["decode"] = modes["eager"]
    results["decode_graphs"] = modes["graphs"]


def _decode_step_ms(llm, B: int, steps: int) -> tuple[float, float]:
    """(median wall ms of a decode step, mean ms of GPU kernel time a step from the profiler)."""
    from engine import SamplingParams

    eng = llm.engine
    gen = torch.Generator().manual_seed(B)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    rids = [eng.add_request(torch.randint(0, 4096, (128,), generator=gen).tolist(), params) for _ in range(B)]
    while any(not eng.requests[r].output_token_ids for r in rids):  # prefill every row
        eng.step()
    for _ in range(3):  # warm-up decode steps
        eng.step()
    times = []
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        eng.step()
        sync()
        times.append(time.perf_counter() - t0)
    gpu_ms = float("nan")
    if torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile

        n = 5
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                eng.step()
            torch.cuda.synchronize()
        us = sum(e.self_device_time_total for e in prof.key_averages())
        gpu_ms = us / 1e3 / n
    while eng.has_unfinished():
        eng.step()
    return statistics.median(times) * 1e3, gpu_ms


def transfer(results: dict, reps: int, device: str = "cuda") -> None:
    """bench/transfer.py in its own process (its ranks are spawned processes that import it)."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "transfer.json"
        cmd = [sys.executable, str(Path(__file__).with_name("transfer.py")), "--device", device]
        cmd += ["--tokens", "4096", "--tp", "1", "2", "--reps", str(reps), "--json", str(out)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"bench/transfer.py exited {r.returncode}:\n{r.stdout[-2000:]}{r.stderr[-4000:]}")
        rows = json.loads(out.read_text())
    for row in rows:
        gbs = row["bytes"] / row["time"] / 1e9
        ratio = row["contig"] / row["time"]
        print(
            f"transfer TP {row['tp']}, {row['tokens']} tokens, {row['bytes'] / 1e6:.1f} MB {device} -> {device}: "
            f"{gbs:.2f} GB/s, one contiguous NIXL WRITE {row['bytes'] / row['contig'] / 1e9:.2f} GB/s, "
            f"ratio contiguous/ours {ratio:.2f}",
            flush=True,
        )
        results.setdefault("transfer", []).append(
            {
                "tp": row["tp"],
                "tokens": row["tokens"],
                "bytes": row["bytes"],
                "gbs": gbs,
                "ratio_contig_over_ours": ratio,
            }
        )


SECTIONS = {
    "gdn": lambda r, reps: gdn_prefill(r),
    "attention": lambda r, reps: paged_attention(r),
    "moe": lambda r, reps: moe_block(r),
    "sampler": lambda r, reps: sampler(r),
    "decode": decode_steps,
    "transfer": transfer,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", nargs="+", choices=SECTIONS, help="run these sections alone")
    args = ap.parse_args()
    run = set(args.only or SECTIONS)
    results: dict = {}
    if not torch.cuda.is_available():
        results["skipped"] = "no CUDA device (torch.cuda.is_available() is False)"
        print(f"benchmark skipped: {results['skipped']}")
    else:
        results["device"] = torch.cuda.get_device_name()
        print(f"on {results['device']}")
        for name in (n for n in SECTIONS if n in run):
            SECTIONS[name](results, args.reps)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

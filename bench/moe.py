"""MoE routed-experts benchmark (not a test): kernels.moe.fused_moe against transformers' experts
module on the same weights and routing at Qwen3.5-35B-A3B's per-layer sizes (fewer experts);
`--cuda` times the Triton kernels with bf16 and FP8 experts.

    python bench/moe.py [--experts 128] [--tokens 1,16,512] [--reps 5] [--cpu-time] [--cuda | --smoke]"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported

import torch  # noqa: E402

from kernels.moe import fused_moe, select_experts  # noqa: E402


def _once(fn, clock) -> float:
    t0 = clock()
    fn()
    return clock() - t0


def hf_experts(H: int, I: int, E: int, k: int, impl: str, w13: torch.Tensor, w2: torch.Tensor):
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts

    config = Qwen3_5MoeTextConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=k)
    config._experts_implementation = impl
    experts = Qwen3_5MoeExperts(config)
    experts.gate_up_proj.data = w13  # shared, not copied
    experts.down_proj.data = w2
    return experts.eval()


def cuda_part(H: int, I: int, E: int, k: int, tokens: list[int], smoke: bool) -> None:
    from kernels.fp8 import quant_fp8_block
    from kernels.triton.moe import fused_moe_triton

    if smoke:
        H, I, E, k, block, device = 64, 32, 6, 3, (16, 16), "cpu"
        tokens = [1, 16]

        def ms(fn):
            return _once(fn, time.perf_counter) * 1e3
    else:
        import triton.testing

        block, device = (128, 128), "cuda"

        def ms(fn):
            return triton.testing.do_bench(fn, warmup=25, rep=100)

    dt = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) * H**-0.5).to(dt).to(device)
    w2 = (torch.randn(E, H, I, generator=gen) * I**-0.5).to(dt).to(device)
    q13, s13 = quant_fp8_block(w13, block)
    q2, s2 = quant_fp8_block(w2, block)
    hf = hf_experts(H, I, E, k, "grouped_mm", w13, w2)
    print(f"Triton fused MoE H={H} I={I} E={E} top-{k} bf16 on {device}; GB/s over the experts' weights hit")
    print(f"{'T':>5} {'active':>6} {'bf16 ms':>8} {'GB/s':>6} {'fp8 ms':>8} {'GB/s':>6} {'hf ms':>8} {'hf/bf16':>8}")
    for T in tokens:
        x = torch.randn(T, H, generator=gen).to(dt).to(device)
        tw, ti = (t.to(device) for t in select_experts(torch.randn(T, E, generator=gen), k, renormalize=True))
        active = int(torch.unique(ti).numel())
        with torch.inference_mode():
            t16 = ms(lambda: fused_moe_triton(x, w13, w2, tw, ti))
            t8 = ms(lambda: fused_moe_triton(x, q13, q2, tw, ti, s13, s2, block))
            thf = ms(lambda: hf(x, ti, tw.to(dt)))
        mel = active * 3 * H * I / 1e6  # weight elements read, in millions; bytes / 1e6 / ms = GB/s
        print(
            f"{T:>5} {active:>6} {t16:>8.3f} {2 * mel / t16:>6.0f} {t8:>8.3f} {mel / t8:>6.0f} {thf:>8.3f} "
            f"{thf / t16:>7.2f}x"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", default="1,16,512")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="time by this process's CPU time, not wall time "
        "(steadier on a shared machine; with --threads 1 it is the single thread's time)",
    )
    ap.add_argument("--cuda", action="store_true", help="the Triton kernels on a GPU")
    ap.add_argument("--smoke", action="store_true", help="the --cuda code on tiny shapes under the interpreter")
    a = ap.parse_args()
    if a.cuda or a.smoke:
        if a.cuda and not torch.cuda.is_available():
            print("no CUDA device: nothing to time")
            return
        cuda_part(a.hidden, a.intermediate, a.experts, a.top_k, [int(t) for t in a.tokens.split(",")], a.smoke)
        return
    if a.threads:
        torch.set_num_threads(a.threads)
    H, I, E, k = a.hidden, a.intermediate, a.experts, a.top_k
    clock = time.process_time if a.cpu_time else time.perf_counter
    gen = torch.Generator().manual_seed(0)
    print(
        f"MoE experts H={H} I={I} E={E} top-{k}, {torch.get_num_threads()} threads, "
        f"median of {a.reps} alternating runs, {'CPU' if a.cpu_time else 'wall'} time"
    )
    cols = (
        ("dtype", 9),
        ("T", 5),
        ("ours ms", 9),
        ("eager ms", 9),
        ("grouped ms", 10),
        ("eager/ours", 10),
    )
    cols += ("grouped/ours", 12), ("max rel diff", 12)
    print(" ".join(f"{name:>{width}}" for name, width in cols))
    for dt in (getattr(torch, d) for d in a.dtypes.split(",")):
        w13 = (torch.randn(E, 2 * I, H, generator=gen) * H**-0.5).to(dt)
        w2 = (torch.randn(E, H, I, generator=gen) * I**-0.5).to(dt)
        impls = {name: hf_experts(H, I, E, k, name, w13, w2) for name in ("eager", "grouped_mm")}
        for T in (int(t) for t in a.tokens.split(",")):
            x = torch.randn(T, H, generator=gen).to(dt)
            tw, ti = select_experts(torch.randn(T, E, generator=gen), k, renormalize=True)
            fns = {"ours": lambda: fused_moe(x, w13, w2, tw, ti)}
            for name, mod in impls.items():
                fns[name] = lambda mod=mod: mod(x, ti, tw.to(dt))
            with torch.inference_mode():
                outs = {name: fn() for name, fn in fns.items()}  # also the warm-up
                ref = outs["grouped_mm"].double()
                diff = max(((o.double() - ref).abs().max() / ref.abs().max()).item() for o in outs.values())
                times = {name: [] for name in fns}
                for _ in range(a.reps):
                    for name, fn in fns.items():
                        times[name].append(_once(fn, clock))
            ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            eager, grouped = ms["eager"] / ms["ours"], ms["grouped_mm"] / ms["ours"]
            print(
                f"{str(dt).removeprefix('torch.'):>9} {T:>5} {ms['ours']:>9.2f} {ms['eager']:>9.2f} "
                f"{ms['grouped_mm']:>10.2f} {eager:>9.2f}x {grouped:>11.2f}x {diff:>12.1e}"
            )
        del w13, w2, impls


if __name__ == "__main__":
    main()

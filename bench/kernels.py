"""Kernel benchmark (not a test): on the CPU our GDN chunked prefill against transformers'; on CUDA
every Triton kernel at Qwen3.5-like sizes with achieved bandwidth and FLOP/s, and fla's where
installed.

    python bench/kernels.py [--cpu-only [--reps 9] [--threads 1]] [--smoke]"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.timing import call_times  # noqa: E402
from kernels.gdn import l2norm  # noqa: E402


def _median_s(fn, reps: int) -> float:
    return statistics.median(call_times(fn, reps))


def _gdn_inputs(B, T, hk, hv, dk, dv, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    N = B * T
    q = l2norm(torch.randn(N, hk, dk, generator=gen)).to(dtype)
    k = l2norm(torch.randn(N, hk, dk, generator=gen)).to(dtype)
    v = torch.randn(N, hv, dv, generator=gen).to(dtype)
    g = -F.softplus(torch.randn(N, hv, generator=gen) - 1.0)
    beta = torch.sigmoid(torch.randn(N, hv, generator=gen))
    cu = torch.arange(B + 1, dtype=torch.int64) * T
    return tuple(x.to(device) for x in (q, k, v, g, beta, cu))


# ---------------------------------------------------------------- CPU


def cpu_part(reps: int = 5) -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    from kernels.gdn import gdn_chunk_prefill

    B, T, hk, hv, dk, dv = 4, 1024, 4, 8, 64, 64
    q, k, v, g, beta, cu = _gdn_inputs(B, T, hk, hv, dk, dv, torch.float32, "cpu")
    slots = torch.arange(B)
    no_init = torch.zeros(B, dtype=torch.bool)

    def ours():
        pool = torch.empty(B, hv, dk, dv)
        return gdn_chunk_prefill(q, k, v, g, beta, cu, pool, slots, no_init), pool

    def theirs():
        shape = lambda x: x.view(B, T, *x.shape[1:])  # noqa: E731
        return torch_chunk_gated_delta_rule(
            shape(q), shape(k), shape(v), shape(g), shape(beta), chunk_size=64, output_final_state=True
        )

    with torch.inference_mode():
        (o1, s1), (o2, s2) = ours(), theirs()
        diff = max(
            ((o1 - o2.reshape(o1.shape)).abs().max() / o2.abs().max()).item(),
            ((s1 - s2).abs().max() / s2.abs().max()).item(),
        )
        # Alternate the two so that load from other processes hits both alike.
        pairs = [(_median_s(ours, 1), _median_s(theirs, 1)) for _ in range(reps)]
        t_ours = statistics.median(p[0] for p in pairs)
        t_theirs = statistics.median(p[1] for p in pairs)
    print(
        f"CPU GDN chunked prefill  B={B} T={T} Hk={hk} Hv={hv} dk={dk} dv={dv} float32, "
        f"{torch.get_num_threads()} threads, median of {reps} alternating runs"
    )
    print(f"  kernels.gdn.gdn_chunk_prefill (PyTorch)       {t_ours * 1e3:9.1f} ms")
    print(f"  transformers torch_chunk_gated_delta_rule     {t_theirs * 1e3:9.1f} ms")
    print(
        f"  ratio transformers / ours                     {t_theirs / t_ours:9.2f}x "
        f"({'ours' if t_ours < t_theirs else 'transformers'} faster)"
    )
    print(f"  max relative difference of outputs and states {diff:9.1e}")


# ---------------------------------------------------------------- CUDA


class Timer:
    def __init__(self, device: str):
        self.device = device

    def ms(self, fn) -> float:
        if self.device == "cuda":
            import triton.testing

            return triton.testing.do_bench(fn, warmup=25, rep=100)
        return _median_s(fn, 1) * 1e3


def ceilings(device: str) -> tuple[float, float]:
    """(GB/s of a large device copy, TFLOP/s of a float32 matmul without TF32)."""
    if device != "cuda":
        return float("nan"), float("nan")
    import triton.testing

    x = torch.empty(1 << 28, dtype=torch.float32, device=device)  # 1 GiB
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x))
    gbs = 2 * x.numel() * 4 / ms / 1e6
    del x, y
    n = 8192
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ms = triton.testing.do_bench(lambda: a @ b)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    return gbs, 2 * n**3 / ms / 1e9


def nbytes(*xs) -> int:
    return sum(x.numel() * x.element_size() for x in xs)


def cuda_part(device: str, small: bool) -> None:
    from engine.cache.allocator import kv_pool_view
    from kernels.triton.conv import causal_conv1d_triton, causal_conv1d_update_triton
    from kernels.triton.gdn_chunk import gdn_chunk_prefill_triton
    from kernels.triton.gdn_recurrent import gdn_recurrent_triton
    from kernels.triton.norm import gated_rms_norm_triton
    from kernels.triton.paged_attention import paged_attention_triton, store_kv_triton

    timer = Timer(device)
    dt = torch.bfloat16
    # Per-rank Qwen3.5-like sizes; --smoke shrinks them for the interpreter.
    if small:
        hk, hv, dk, dv, kc = 2, 4, 16, 32, 4
        H, KVH, hd, bs = 4, 2, 32, 16
        Bp, Tp, Bd, ctx, spec_k = 2, 64, 4, 64, 3
    else:
        hk, hv, dk, dv, kc = 16, 32, 128, 128, 4
        H, KVH, hd, bs = 16, 2, 256, 16
        Bp, Tp, Bd, ctx, spec_k = 4, 4096, 128, 4096, 3
    D = 2 * hk * dk + hv * dv
    rows = []  # (name, ms, bytes, flops)

    # GDN chunked prefill
    q, k, v, g, beta, cu = _gdn_inputs(Bp, Tp, hk, hv, dk, dv, dt, device)
    pool = torch.zeros(Bp, hv, dk, dv, device=device)
    slots = torch.arange(Bp, device=device)
    ms = timer.ms(lambda: gdn_chunk_prefill_triton(q, k, v, g, beta, cu, pool, slots))
    C, SUB = 64, 16
    n_chunks = Bp * -(-Tp // C) * hv
    n_vblk = -(-dv // 64)
    per_chunk = (  # matmul flops executed per (chunk, head, dv block)
        2 * C * C * dk * 2
        + (SUB - 1) * 2 * C**3
        + (C // SUB - 1) * 4 * C**3
        + 2 * C * C * (dk + 64)
        + 2 * C * C * 64
        + 3 * 2 * C * dk * 64
    )
    rows.append(
        ("gdn_chunk_prefill", ms, nbytes(q, k, v, g, beta, v) + 2 * nbytes(pool), n_chunks * n_vblk * per_chunk)
    )

    # GDN recurrent decode: plain rows, then a batch mixing plain and k+1-token rows
    for name, lens in (("gdn_recurrent plain", [1] * Bd), ("gdn_recurrent mixed 1/k+1", [1, spec_k + 1] * (Bd // 2))):
        Tn = sum(lens)
        q, k, v, g, beta, _ = _gdn_inputs(1, Tn, hk, hv, dk, dv, dt, device)
        cu = torch.tensor([0, *lens], device=device).cumsum(0)
        pool = torch.zeros(Bd, hv, dk, dv, device=device)
        slots = torch.arange(Bd, device=device)
        inter = torch.empty(Bd, max(lens), hv, dk, dv, device=device)
        ms = timer.ms(lambda: gdn_recurrent_triton(q, k, v, g, beta, cu, pool, slots, intermediate_states=inter))
        moved = nbytes(q, k, v, g, beta, v) + 2 * nbytes(pool) + Tn * hv * dk * dv * 4
        rows.append((name, ms, moved, Tn * hv * 6 * dk * dv))

    # Causal conv1d: prefill and 1-token update
    x = torch.randn(Bp * Tp, D, device=device, dtype=dt)
    w = torch.randn(D, kc, device=device, dtype=dt)
    cpool = torch.zeros(Bp, D, kc - 1, device=device, dtype=dt)
    cu = torch.arange(Bp + 1, device=device) * Tp
    slots = torch.arange(Bp, device=device)
    ms = timer.ms(lambda: causal_conv1d_triton(x, w, cu, cpool, slots))
    rows.append(("causal_conv1d prefill", ms, 2 * nbytes(x) + 2 * nbytes(cpool), 2 * kc * x.numel()))
    x = torch.randn(Bd, D, device=device, dtype=dt)
    cpool = torch.zeros(Bd, D, kc - 1, device=device, dtype=dt)
    slots = torch.arange(Bd, device=device)
    ms = timer.ms(lambda: causal_conv1d_update_triton(x, w, cpool, slots))
    rows.append(("causal_conv1d_update", ms, 2 * nbytes(x) + 2 * nbytes(cpool), 2 * kc * x.numel()))

    # KV store and paged attention (decode; prefill)
    nblk = Bd * -(-ctx // bs) + 1
    kv = kv_pool_view(torch.randn(KVH, nblk, 2, bs, hd, device=device, dtype=dt))  # head-major, as the engine
    tables = torch.arange(1, nblk, device=device, dtype=torch.int32).view(Bd, -1)
    kn = torch.randn(Bd, KVH, hd, device=device, dtype=dt)
    slot_map = tables[:, -1].long() * bs
    ms = timer.ms(lambda: store_kv_triton(kn, kn, kv, slot_map))
    rows.append(("store_kv decode", ms, 4 * nbytes(kn), 0))
    qd = torch.randn(Bd, H, hd, device=device, dtype=dt)
    cuq = torch.arange(Bd + 1, device=device)
    seq = torch.full((Bd,), ctx, device=device)
    ms = timer.ms(lambda: paged_attention_triton(qd, kv, cuq, seq, tables, hd**-0.5))
    rows.append(("paged_attention decode", ms, nbytes(kv) + 2 * nbytes(qd), 4 * Bd * H * ctx * hd))
    Bq = min(Bp, Bd)
    qp = torch.randn(Bq * Tp, H, hd, device=device, dtype=dt)
    cuq = torch.arange(Bq + 1, device=device) * Tp
    seq = torch.full((Bq,), Tp, device=device)
    tp = torch.arange(1, 1 + Bq * -(-Tp // bs), device=device, dtype=torch.int32).view(Bq, -1)
    ms = timer.ms(lambda: paged_attention_triton(qp, kv, cuq, seq, tp, hd**-0.5))
    rows.append(("paged_attention prefill", ms, 2 * nbytes(qp) + 2 * Bq * Tp * KVH * hd * 2, 2 * Bq * H * Tp * Tp * hd))

    # Gated RMSNorm over the GDN output
    xo = torch.randn(Bp * Tp, hv, dv, device=device, dtype=dt)
    z = torch.randn_like(xo)
    wn = torch.ones(dv, device=device, dtype=dt)
    ms = timer.ms(lambda: gated_rms_norm_triton(xo, z, wn, 1e-6))
    rows.append(("gated_rms_norm", ms, 3 * nbytes(xo), 0))

    gbs, tfl = ceilings(device)
    name = torch.cuda.get_device_name() if device == "cuda" else "Triton interpreter (smoke run: times mean nothing)"
    print(f"\nTriton kernels on {name}; ceilings: copy {gbs:.0f} GB/s, float32 matmul (no TF32) {tfl:.1f} TFLOP/s")
    print(f"  {'kernel':28s} {'ms':>9s} {'GB/s':>8s} {'%bw':>5s} {'TFLOP/s':>8s} {'%fp32':>6s}")
    for n, ms, b, f in rows:
        g_, t_ = b / ms / 1e6, f / ms / 1e9
        print(f"  {n:28s} {ms:9.3f} {g_:8.1f} {100 * g_ / gbs:5.0f} {t_:8.2f} {100 * t_ / tfl:6.0f}")
    fla_part(device, timer, hk, hv, dk, dv, Bp, Tp, Bd, dt)


def fla_part(device, timer, hk, hv, dk, dv, Bp, Tp, Bd, dt) -> None:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError:
        print("  flash-linear-attention (fla) is not installed: no comparison")
        return
    if device != "cuda":
        return
    try:
        _fla_compare(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, timer, hk, hv, dk, dv, Bp, Tp, Bd, dt)
    except Exception as e:  # fla's API moves; a failed comparison should not hide the table above
        print(f"  fla comparison failed: {type(e).__name__}: {e}")


def _fla_compare(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, timer, hk, hv, dk, dv, Bp, Tp, Bd, dt):
    device = "cuda"
    from kernels.triton.gdn_chunk import gdn_chunk_prefill_triton
    from kernels.triton.gdn_recurrent import gdn_recurrent_triton

    q, k, v, g, beta, cu = _gdn_inputs(Bp, Tp, hk, hv, dk, dv, dt, device)
    pool = torch.zeros(Bp, hv, dk, dv, device=device)
    slots = torch.arange(Bp, device=device)
    rep = hv // hk
    qe, ke = q.repeat_interleave(rep, 1)[None], k.repeat_interleave(rep, 1)[None]
    ours = timer.ms(lambda: gdn_chunk_prefill_triton(q, k, v, g, beta, cu, pool, slots))
    theirs = timer.ms(
        lambda: chunk_gated_delta_rule(
            qe, ke, v[None], g[None], beta[None].to(dt), initial_state=pool, output_final_state=True, cu_seqlens=cu
        )
    )
    print(
        f"  vs fla chunk_gated_delta_rule:          ours {ours:.3f} ms, fla {theirs:.3f} ms, ratio {ours / theirs:.2f}x"
    )
    q, k, v, g, beta, _ = _gdn_inputs(1, Bd, hk, hv, dk, dv, dt, device)
    cu = torch.arange(Bd + 1, device=device)
    pool = torch.zeros(Bd, hv, dk, dv, device=device)
    slots = torch.arange(Bd, device=device)
    qe, ke = q.repeat_interleave(rep, 1)[None], k.repeat_interleave(rep, 1)[None]
    ours = timer.ms(lambda: gdn_recurrent_triton(q, k, v, g, beta, cu, pool, slots))
    theirs = timer.ms(
        lambda: fused_recurrent_gated_delta_rule(
            qe, ke, v[None], g[None], beta[None].to(dt), initial_state=pool, output_final_state=True, cu_seqlens=cu
        )
    )
    print(
        f"  vs fla fused_recurrent_gated_delta_rule: ours {ours:.3f} ms, fla {theirs:.3f} ms, ratio {ours / theirs:.2f}x"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-only", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CUDA table on tiny shapes under the Triton interpreter")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions of each CPU op")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.smoke:
        cuda_part("cpu", small=True)
        return 0
    cpu_part(args.reps)
    if args.cpu_only:
        return 0
    if not torch.cuda.is_available():
        print("\nCUDA part: no GPU present (torch.cuda.is_available() is False); skipped.")
        return 0
    cuda_part("cuda", small=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

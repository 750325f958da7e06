"""MoE routing and routed experts: select_experts against transformers' Qwen3.5-MoE and
Qwen3-Next routers, the CPU fused_moe against the naive per-token loop and against
transformers' experts and sparse MoE block with the same weights, FP8 experts, the Triton
kernel (interpreter without a GPU) against the PyTorch path, and the argument checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels.fp8 import dequant_fp8_block, quant_fp8_block
from kernels.moe import fused_moe, select_experts
from tests.helpers.kernel_testing import DEVICE, NAIVE_TOL, TOL, assert_close, to_dev

DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.bfloat16, id="bf16")]
# (T, H, I, E, k): odd sizes, experts not a power of two, top-k 3; T=1 is a decode step; with
# T*k < E some experts get no rows.
SHAPES = [
    pytest.param((1, 24, 10, 5, 3), id="T1-E5-k3"),
    pytest.param((7, 40, 12, 5, 3), id="T7-E5-k3"),
    pytest.param((3, 32, 7, 11, 2), id="T3-E11-k2-idle-experts"),
    pytest.param((33, 48, 20, 6, 1), id="T33-E6-k1"),
    pytest.param((64, 32, 16, 3, 3), id="T64-E3-k3-all-experts"),
]


def naive_moe(x, w13, w2, topk_weights, topk_ids):
    """Loop over tokens and their k experts, in float64."""
    T, k = topk_ids.shape
    I = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(T):
        xt = x[t].double()
        for j in range(k):
            e = int(topk_ids[t, j])
            h = w13[e].double() @ xt
            out[t] += float(topk_weights[t, j]) * (w2[e].double() @ (F.silu(h[:I]) * h[I:]))
    return out


def make_case(T, H, I, E, k, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) * H**-0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=gen) * I**-0.5).to(dtype)
    logits = torch.randn(T, E, generator=gen).to(dtype)
    topk_weights, topk_ids = select_experts(logits, k, renormalize=True)
    return x, w13, w2, topk_weights, topk_ids


def tiny_moe_config(arch: str, H: int, I: int, E: int, k: int, **extra):
    """A transformers text config with only the MoE sizes that matter here."""
    if arch == "qwen3_5_moe":
        from transformers import Qwen3_5MoeTextConfig as Config
    else:
        from transformers import Qwen3NextConfig as Config
    return Config(
        hidden_size=H,
        moe_intermediate_size=I,
        shared_expert_intermediate_size=I + 3,
        num_experts=E,
        num_experts_per_tok=k,
        num_hidden_layers=1,
        vocab_size=32,
        **extra,
    )


def hf_block(arch: str, config, dtype, seed=0):
    """transformers' sparse MoE block with random weights."""
    if arch == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock as Block
    else:
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock as Block
    gen = torch.Generator().manual_seed(seed)
    block = Block(config)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return block.to(dtype).eval()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "arch,renormalize",
    [("qwen3_5_moe", True), ("qwen3_next", True), ("qwen3_next", False)],
    ids=["qwen3.5-moe", "qwen3-next-norm", "qwen3-next-no-norm"],
)
def test_select_experts_matches_transformers_router(arch, renormalize, dtype):
    config = tiny_moe_config(arch, 32, 8, 7, 3, **({} if arch == "qwen3_5_moe" else {"norm_topk_prob": renormalize}))
    router = hf_block(arch, config, dtype).gate
    h = torch.randn(19, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        logits, weights_hf, ids_hf = router(h)
    weights, ids = select_experts(logits, 3, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, ids_hf)
    # transformers hands the weights on in the hidden dtype: ours round to exactly those.
    assert torch.equal(weights.to(dtype), weights_hf)
    probs = torch.softmax(logits.double(), -1)
    ref = probs.gather(1, ids)
    assert_close("topk_weights", weights, ref / ref.sum(-1, keepdim=True) if renormalize else ref, NAIVE_TOL)


@pytest.mark.parametrize("shape", SHAPES)
def test_fused_moe_matches_naive(shape):
    x, w13, w2, tw, ti = make_case(*shape, torch.float32)
    out = fused_moe(x, w13, w2, tw, ti)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert_close("out", out, naive_moe(x, w13, w2, tw, ti), NAIVE_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 30], ids=lambda t: f"T{t}")
def test_fused_moe_cpu_paths_agree(T, dtype, monkeypatch):
    """torch's grouped GEMM (aligned float32, or one row per expert) and one GEMM per expert."""
    import kernels.moe

    x, w13, w2, tw, ti = make_case(T, 32, 16, 5, 3, dtype, seed=11)
    grouped = fused_moe(x, w13, w2, tw, ti)
    monkeypatch.setattr(kernels.moe, "_grouped_gemm_ok", lambda *a: False)
    assert_close("out", fused_moe(x, w13, w2, tw, ti), grouped, TOL[dtype] / 10)


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 5, 40], ids=lambda t: f"T{t}")
def test_fused_moe_matches_transformers_experts(T, dtype, impl):
    """Same weights in transformers' Qwen3.5-MoE experts module, both its implementations; T=40
    gives every expert enough rows for the CPU path's float32 GEMMs in bf16. (I = 24: torch's
    grouped_mm wants 16-byte strides.)"""
    H, I, E, k = 48, 24, 5, 3
    config = tiny_moe_config("qwen3_5_moe", H, I, E, k)
    config._experts_implementation = impl
    experts = hf_block("qwen3_5_moe", config, dtype).experts
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).to(dtype)
    tw, ti = select_experts(torch.randn(T, E, generator=torch.Generator().manual_seed(3)), k, True)
    with torch.no_grad():
        ref = experts(x, ti, tw.to(dtype))
    out = fused_moe(x, experts.gate_up_proj.data, experts.down_proj.data, tw, ti)
    assert out.dtype == dtype
    assert_close("out", out, ref, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_next"])
def test_moe_block_matches_transformers(arch, dtype):
    """The whole sparse MoE block from these ops: router linear, select_experts, fused_moe, and the
    sigmoid-gated shared expert, against transformers' block with the same weights."""
    H, I, E, k = 40, 12, 6, 3
    block = hf_block(arch, tiny_moe_config(arch, H, I, E, k), dtype, seed=4)
    h = torch.randn(2, 9, H, generator=torch.Generator().manual_seed(5)).to(dtype)
    x = h.view(-1, H)
    se = block.shared_expert
    with torch.no_grad():
        ref = block(h)
        tw, ti = select_experts(F.linear(x, block.gate.weight), k, renormalize=True)
        routed = fused_moe(x, block.experts.gate_up_proj, block.experts.down_proj, tw, ti)
        shared = se.down_proj(F.silu(se.gate_proj(x)) * se.up_proj(x)) * torch.sigmoid(block.shared_expert_gate(x))
    assert_close("block out", (routed + shared).view_as(h), ref, TOL[dtype])


def test_fused_moe_tp_slices_sum_to_full():
    """Each tensor-parallel rank holds a slice of every expert's intermediate dimension; the
    ranks' partial outputs add up to the full experts' output."""
    T, H, I, E, k = 9, 32, 12, 5, 3
    x, w13, w2, tw, ti = make_case(T, H, I, E, k, torch.float32, seed=6)
    full = fused_moe(x, w13, w2, tw, ti)
    parts = []
    for r in range(2):
        sl = slice(r * I // 2, (r + 1) * I // 2)
        w13_r = torch.cat([w13[:, :I][:, sl], w13[:, I:][:, sl]], dim=1)
        parts.append(fused_moe(x, w13_r, w2[:, :, sl].contiguous(), tw, ti))
    assert_close("sum of TP partials", parts[0] + parts[1], full, NAIVE_TOL)


def test_fused_moe_no_tokens():
    x, w13, w2, tw, ti = make_case(0, 16, 8, 5, 3, torch.float32)
    assert fused_moe(x, w13, w2, tw, ti).shape == (0, 16)


def test_fused_moe_rejects_bad_arguments():
    x, w13, w2, tw, ti = make_case(4, 16, 8, 5, 3, torch.float32)
    with pytest.raises(ValueError, match=r"w2=\(5, 16, 9\)"):
        fused_moe(x, w13, torch.zeros(5, 16, 9), tw, ti)
    with pytest.raises(ValueError, match=r"topk_ids=\(3, 3\)"):
        fused_moe(x, w13, w2, tw[:3], ti[:3])
    with pytest.raises(ValueError, match=r"w13=\(5, 16, 16\):bfloat16"):
        fused_moe(x, w13.bfloat16(), w2, tw, ti)
    with pytest.raises(ValueError, match=r"topk_ids must be in \[0, E=5\) \(got min 0, max 5\)"):
        fused_moe(x, w13, w2, tw, torch.where(ti == ti.max(), 5, ti))
    with pytest.raises(ValueError, match=r"top_k must be in \[1, E=5\] \(got 6\)"):
        select_experts(torch.zeros(4, 5), 6, True)


def fp8_experts(w13, w2, block):
    q13, s13 = quant_fp8_block(w13.float(), block)
    q2, s2 = quant_fp8_block(w2.float(), block)
    return q13, q2, s13, s2


@pytest.mark.parametrize("block", [(16, 16), (8, 12)], ids=["b16", "b8x12"])
def test_fused_moe_fp8_experts_match_dequantized(block):
    """FP8 experts give what the dequantized experts give (the CPU load path's weights)."""
    x, w13, w2, tw, ti = make_case(9, 40, 12, 5, 3, torch.bfloat16, seed=7)
    q13, q2, s13, s2 = fp8_experts(w13, w2, block)
    out = fused_moe(x, q13, q2, tw, ti, s13, s2, block)
    ref = fused_moe(x, dequant_fp8_block(q13, s13, block, x.dtype), dequant_fp8_block(q2, s2, block, x.dtype), tw, ti)
    assert torch.equal(out, ref)


def test_align_by_expert_layout():
    from kernels.triton.moe import align_by_expert

    topk_ids = torch.tensor([[4, 0], [4, 2], [0, 4], [4, 1]])  # expert 3 idle, expert 4 has 4 pairs
    slot_pair, block_expert = align_by_expert(topk_ids, 5, 2)
    P = 8
    assert block_expert.tolist() == [0, 1, 2, 4, 4, 5, 5, 5, 5]  # 4 blocks used of ceil(8/2) + 5
    assert slot_pair.view(-1, 2).tolist()[:5] == [[1, 4], [7, P], [3, P], [0, 2], [5, 6]]
    assert (slot_pair[10:] == P).all()


TRITON_SHAPES = [
    pytest.param((1, 24, 10, 5, 3), id="T1-E5-k3"),
    pytest.param((7, 40, 12, 5, 3), id="T7-E5-k3"),
    pytest.param((3, 32, 7, 11, 2), id="T3-E11-k2-idle-experts", marks=pytest.mark.slow),
    pytest.param((40, 48, 20, 6, 3), id="T40-E6-k3", marks=pytest.mark.slow),
    pytest.param((300, 64, 40, 9, 3), id="T300-E9-k3", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", TRITON_SHAPES)
def test_fused_moe_triton_matches_reference(shape, dtype):
    from kernels.triton.moe import fused_moe_triton

    x, w13, w2, tw, ti = make_case(*shape, dtype, seed=8)
    ref = fused_moe(x, w13, w2, tw, ti)
    out = fused_moe_triton(*to_dev(x, w13, w2, tw, ti))
    assert out.dtype == dtype and out.device.type == DEVICE
    assert_close("out", out, ref, TOL[dtype])


@pytest.mark.parametrize(
    "dtype,block", [(torch.bfloat16, (16, 16)), (torch.float32, (8, 12))], ids=["bf16-b16", "f32-b8x12-unaligned"]
)
def test_fused_moe_triton_fp8_experts(dtype, block):
    from kernels.triton.moe import fused_moe_triton

    x, w13, w2, tw, ti = make_case(6, 40, 12, 5, 3, dtype, seed=9)
    q13, q2, s13, s2 = fp8_experts(w13, w2, block)
    ref = fused_moe(x, q13, q2, tw, ti, s13, s2, block)
    out = fused_moe_triton(*to_dev(x, q13, q2, tw, ti, s13, s2), block)
    assert_close("out", out, ref, TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 16, 512], ids=lambda t: f"T{t}")
def test_fused_moe_triton_gpu_sizes(T, dtype):
    """Qwen3.5-35B-A3B's expert sizes at TP 2 (I = 256 of 512) with fewer experts, and FP8 experts."""
    from kernels.triton.moe import fused_moe_triton

    x, w13, w2, tw, ti = make_case(T, 2048, 256, 64, 8, dtype, seed=10)
    assert_close("out", fused_moe_triton(*to_dev(x, w13, w2, tw, ti)), fused_moe(x, w13, w2, tw, ti), TOL[dtype])
    q13, q2, s13, s2 = fp8_experts(w13, w2, (128, 128))
    ref = fused_moe(x, q13, q2, tw, ti, s13, s2, (128, 128))
    assert_close("out fp8", fused_moe_triton(*to_dev(x, q13, q2, tw, ti, s13, s2), (128, 128)), ref, TOL[dtype])


@pytest.mark.slow
def test_triton_kernels_compile_for_hopper():
    """The MoE and FP8 kernels compile for sm_90 in every dtype and flag combination, which the
    interpreter alone does not show (a process without TRITON_INTERPRET; no GPU needed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_for_hopper.py")
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-4000:]

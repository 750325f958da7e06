"""Dense projections of an FP8 checkpoint kept in float8 (`fp8_dense="keep"`; on the CPU through
the PyTorch reference of `kernels.fp8_block_linear`): the same products from the same weights as
the dequantized load, so log-probabilities agree to float32 rounding, at TP 1 and 2, dense and
MoE, with tensor-parallel slices that do not fall on block boundaries."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.linear import Linear
from engine.tiny_model import make_tiny_model
from kernels.fp8 import dequant_fp8_block, quant_fp8_block
from tests.helpers import hybrid_ckpt as hc

NEW = 6
TOP = 20
# float32 logprobs of the kept path vs the dequantized one: only the GEMMs' summation order differs
BOUND = 1e-4
# hybrid_ckpt's MoE sizes; the dense model in blocks of 32: at TP 2 the attention heads (16 rows) and
# the MLP's 24 of 48 intermediate rows are slices that start or end inside a block
SPECS = {
    "qwen3_5": replace(hc.SPEC_MOE["qwen3_5_moe"], arch="qwen3_5", fp8=True, fp8_block=32),
    "qwen3_5_moe": replace(hc.SPEC_MOE["qwen3_5_moe"], fp8=True, fp8_block=16),
    "qwen3_next": replace(hc.SPEC_MOE["qwen3_next"], fp8=True, fp8_block=16),
}
PARAMS = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=TOP, prompt_logprobs=TOP)


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    made: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in made:
            made[arch] = str(make_tiny_model(tmp_path_factory.mktemp(arch) / "ckpt", SPECS[arch]))
        return made[arch]

    return get


def _run(path: str, prompts, **kw):
    with LLM(path, dtype="float32", engine_process=False, **kw) as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
        linears = _linears(llm) if kw.get("tensor_parallel_size", 1) == 1 else []
    return [o.output_token_ids for o in outs], [_logprob_table(o) for o in outs], linears


def _logprob_table(out) -> dict[tuple[int, int], float]:
    """(position, token id) -> logprob over the prompt's and the output's top-20 alternatives."""
    rows = [{t: x.logprob for t, x in d.items() if x.rank <= TOP} for d in (out.prompt_logprobs or [])[1:]]
    rows += [dict(top) for _, _, top in out.logprobs]
    return {(i, t): lp for i, top in enumerate(rows) for t, lp in top.items()}


def _linears(llm) -> list[tuple[str, Linear]]:
    """(name, projection) of every layer's mixer, MLP or MoE block and shared expert, in order."""
    found = []
    for layer in llm.engine.executor.worker.model.layers:
        for part in (layer.mixer.w, layer.mlp.w, getattr(layer.mlp.w, "shared", None)):
            found += [(k, v) for k, v in getattr(part, "__dict__", {}).items() if isinstance(v, Linear)]
    return found


def _close(kept, ref) -> float:
    common = kept.keys() & ref.keys()
    assert len(common) >= 0.9 * len(ref), "the top-20 alternatives differ beyond near-ties"
    return max(abs(kept[k] - ref[k]) for k in common)


@pytest.mark.parametrize("arch", list(SPECS))
def test_fp8_dense_kept_matches_dequantized(arch, fp8_ckpt):
    path = fp8_ckpt(arch)
    vocab = SPECS[arch].vocab
    prompts = hc.prompts(vocab, (1, 7, 33), seed=11)
    ref_tokens, ref_lps, ref_linears = _run(path, prompts, fp8_dense="dequantize")
    tokens, lps, linears = _run(path, prompts, fp8_dense="keep")
    assert tokens == ref_tokens
    assert max(_close(k, r) for k, r in zip(lps, ref_lps)) < BOUND
    # every projection the checkpoint quantized is float8 in memory (one byte per element plus its
    # float32 scales); the router and the shared-expert gate, left unquantized, are not
    assert [n for n, _ in linears] == [n for n, _ in ref_linears]
    assert not any(lin.kind == "fp8" for _, lin in ref_linears)
    unquantized = ("router", "shared_gate")
    assert all((lin.kind == "fp8") == (n not in unquantized) for n, lin in linears)
    fp8 = [lin for _, lin in linears if lin.kind == "fp8"]
    for lin in fp8:
        assert lin.w.dtype == torch.float8_e4m3fn and lin.w.element_size() == 1
        assert lin.scale_inv is not None and lin.scale_inv.dtype == torch.float32
        assert lin.scale_inv.numel() * 4 <= lin.w.numel() // 2
    kept = sum(lin.w.nbytes + lin.scale_inv.nbytes + (lin.tail.w.nbytes if lin.tail else 0) for lin in fp8)
    deq = sum(r.weight.nbytes for n, r in ref_linears if n not in unquantized)
    assert kept < 0.4 * deq  # float8 against float32: a quarter, plus scales and GDN's b/a rows
    tp_tokens, tp_lps, _ = _run(path, prompts, fp8_dense="keep", tensor_parallel_size=2)
    assert tp_tokens == ref_tokens
    assert max(_close(k, r) for k, r in zip(tp_lps, ref_lps)) < BOUND


def test_fp8_dense_auto_dequantizes_on_cpu(fp8_ckpt):
    with LLM(fp8_ckpt("qwen3_5"), dtype="float32", engine_process=False) as llm:
        assert not any(lin.kind == "fp8" for _, lin in _linears(llm))


def test_fp8_linear_with_tail_equals_dequantized_rows():
    """Linear.fp8 against a naive reference: the dequantized weight by F.linear, tail rows appended."""
    g = torch.Generator().manual_seed(0)
    w, tail, x = torch.randn(40, 48, generator=g), torch.randn(5, 48, generator=g), torch.randn(3, 48, generator=g)
    q, s = quant_fp8_block(w, (16, 16))
    lin = Linear.fp8(q, s, (16, 16), torch.float32, tail)
    ref = torch.cat([x @ dequant_fp8_block(q, s, (16, 16), torch.float32).T, x @ tail.T], dim=1)
    torch.testing.assert_close(lin(x), ref, rtol=1e-5, atol=1e-5)
    assert lin.out_features == 45 and lin.weight.shape == (45, 48)
    with pytest.raises(ValueError, match="scale_inv must be float32"):
        Linear.fp8(q, s[:1], (16, 16), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_fp8_dense_on_cuda_matches_dequantized(arch, fp8_ckpt):
    """On CUDA `auto` keeps the dense projections float8 through the Triton block-FP8 GEMM: float32
    logprobs within BOUND of the dequantized load on the same GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path = fp8_ckpt(arch)
    prompts = hc.prompts(SPECS[arch].vocab, (1, 7, 33), seed=11)
    ref_tokens, ref_lps, _ = _run(path, prompts, fp8_dense="dequantize", device="cuda")
    tokens, lps, linears = _run(path, prompts, device="cuda")
    assert any(lin.kind == "fp8" and lin.w.is_cuda for _, lin in linears)
    assert tokens == ref_tokens
    assert max(_close(k, r) for k, r in zip(lps, ref_lps)) < BOUND


def test_weight_memory_arithmetic_matches_the_loader(tmp_path):
    """bench/weight_memory.py's per-rank bytes (the docs' table) against what the loader holds for
    one rank of a tiny FP8 MoE checkpoint at TP 2 whose slices fall on its 16-row blocks."""
    import dataclasses
    import importlib.util
    import json
    import sys
    from pathlib import Path

    from engine.config import ModelConfig
    from engine.loader import load_weights

    spec = replace(SPECS["qwen3_5_moe"], shared_intermediate=32, moe_intermediate=32)
    path = make_tiny_model(tmp_path / "ckpt", spec)
    bench = Path(__file__).resolve().parents[2] / "bench" / "weight_memory.py"
    mod_spec = importlib.util.spec_from_file_location("weight_memory", bench)
    assert mod_spec is not None and mod_spec.loader is not None
    wm = sys.modules["weight_memory"] = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(wm)
    want = wm.rank_bytes(json.loads((path / "config.json").read_text()), 2, True, block=16)
    ba = 2 * (spec.linear_value_heads // 2) * spec.hidden * 2  # a GDN layer's b and a rows, bfloat16

    def held(v: Linear) -> int:
        # a CPU without bfloat16 GEMMs (AVX2) multiplies a bfloat16 weight from a float32 working copy
        # (gemm_kind "fp32"): counted at the model dtype's size, as a GPU holds it
        if v.kind == "fp32":
            return v.shape[0] * v.shape[1] * v.dtype.itemsize
        return v.w.nbytes + (v.scale_inv.nbytes if v.scale_inv is not None else 0)

    got = {}
    for mode in ("keep", "dequantize"):
        cfg = ModelConfig.from_dir(str(path), "bfloat16")
        layers = load_weights(dataclasses.replace(cfg, fp8_dense=mode, fp8_experts="keep"), 2, 0)["layers"]
        blocks = [b for lw in layers for b in (lw["mixer"], lw["mlp"], lw["mlp"]["shared"])]
        lins = [v for b in blocks for k, v in b.items() if isinstance(v, Linear) and k not in ("router", "shared_gate")]
        got[mode] = sum(held(v) for v in lins)
        if mode == "dequantize":  # the unquantized b/a rows are w_in's tail when kept
            got[mode] -= ba * sum("w_in" in lw["mixer"] for lw in layers)
        moe = [lw["mlp"] for lw in layers]
        got["experts"] = sum(sum(m[k].nbytes for k in ("w13", "w2", "w13_scale_inv", "w2_scale_inv")) for m in moe)
    assert (got["keep"], got["dequantize"], got["experts"]) == (want.dense_fp8, want.dense_bf16, want.experts)


@pytest.mark.parametrize("kept", [{"fp8_experts": "keep"}, {"fp8_dense": "keep"}])
def test_batch_invariant_with_fp8_weights_kept_is_refused_at_start(fp8_ckpt, kept):
    """The batch-invariant GEMMs run bfloat16 weights: asked for with FP8 weights kept, the engine
    refuses at start, naming both options (it started, then failed every request at its step)."""
    with pytest.raises(ValueError, match="--batch-invariant runs bfloat16 weights, not FP8 ones") as e:
        LLM(fp8_ckpt("qwen3_5_moe"), dtype="bfloat16", batch_invariant=True, engine_process=False, **kept)
    assert "keep" in str(e.value)

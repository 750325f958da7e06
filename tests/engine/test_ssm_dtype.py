"""--mamba-ssm-cache-dtype: the GDN recurrent state in bfloat16 on request. Its slots, snapshots
and rollback buffers take half the bytes, the capacity plan gives the difference to KV pages,
and greedy decoding stays within a stated distance of transformers (teacher-forced top-1
agreement; docs/engine.md). The default (auto = float32) keeps transformers' tokens exactly."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from tests.helpers import hybrid_ckpt as hc

NEW = 256
# (model dtype, state dtype) -> (least top-1 agreement, largest logit shortfall). Measured on this
# checkpoint and these prompts (bench/ssm_dtype.py): 100% / 0, 99.3% / 0.009, 98.5% / 0.06, 95.4% / 0.19.
BOUNDS = {
    ("float32", "auto"): (1.0, 1e-4),
    ("float32", "bfloat16"): (0.98, 0.05),
    ("bfloat16", "bfloat16"): (0.93, 0.5),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("ssm")
    return {
        "float32": hc.make(d / "f32", replace(hc.SPEC_BF16, dtype="float32")),
        "bfloat16": hc.make(d / "bf16", hc.SPEC_BF16),
    }


def _state_bytes(path: str, slots: int, state_itemsize: int) -> int:
    """GDN slot bytes of every layer from config.json: conv (model dtype) + recurrent state."""
    c = json.loads((Path(path) / "config.json").read_text())
    hk, hv, dk, dv = (c[f"linear_{n}"] for n in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim"))
    conv = (2 * hk * dk + hv * dv) * (c["linear_conv_kernel_dim"] - 1) * 4  # float32 model
    rec = hv * dk * dv * state_itemsize
    n_gdn = sum(t == "linear_attention" for t in c["layer_types"])
    return slots * n_gdn * (conv + rec)


def test_bf16_state_halves_the_slots_and_feeds_the_kv_pages(ckpts, caplog):
    path = ckpts["float32"]
    kw = dict(dtype="float32", max_num_seqs=8, kv_cache_memory="64MiB", num_speculative_tokens=2)
    with LLM(path, **kw) as llm:
        f32 = llm.capacity()
        assert llm.engine.executor.worker.pools.recurrent[0].dtype == torch.float32
    with caplog.at_level(logging.WARNING), LLM(path, mamba_ssm_cache_dtype="bfloat16", **kw) as llm:
        bf16 = llm.capacity()
        pools = llm.engine.executor.worker.pools
        for t in (pools.recurrent[0], pools.recurrent_scratch[0], pools.snapshots.recurrent[0]):
            assert t.dtype == torch.bfloat16
    assert (f32.state_bytes, bf16.state_bytes) == (_state_bytes(path, 8, 4), _state_bytes(path, 8, 2))
    assert bf16.spec_scratch_bytes == 3 * bf16.state_bytes  # k + 1 states per slot for rollback
    assert bf16.num_blocks > f32.num_blocks and bf16.num_snapshots > f32.num_snapshots
    warned = [r.getMessage() for r in caplog.records if "PyTorch path" in r.getMessage()]
    assert len(warned) == 1 and "bfloat16" in warned[0]


def test_unknown_state_dtype_is_refused(ckpts):
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype must be one of auto, float32, bfloat16"):
        LLM(ckpts["float32"], mamba_ssm_cache_dtype="float16")


@pytest.mark.parametrize(("model", "state"), list(BOUNDS), ids=lambda x: x)
def test_greedy_agreement_with_transformers(ckpts, model, state):
    path = ckpts[model]
    prompts = hc.prompts(lens=(3, 40, 200, 64), seed=5)
    sp = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    with LLM(path, dtype=model, mamba_ssm_cache_dtype=state) as llm:
        toks = [o.output_token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)]
    dt = getattr(torch, model)
    short = torch.cat([hc.hf_logit_shortfall(path, p, t, dtype=dt) for p, t in zip(prompts, toks)])
    agree = (short <= 1e-4).float().mean().item()
    least, most = BOUNDS[(model, state)]
    assert agree >= least, f"top-1 agreement {agree:.3f} < {least}"
    assert short.max().item() <= most, f"a token {short.max().item():.4f} below transformers' max (bound {most})"


def test_bf16_state_with_drafts_and_prefix_snapshots(ckpts):
    """Speculative rows (rollback buffers in bfloat16), chunked prefill and prefix snapshots (saved
    and restored in bfloat16) keep the same bound, the first run and a repeat that resumes from
    the snapshots alike. The two need not be token-identical: the state is rounded where it is
    stored (chunk ends, snapshot points), and a resumed prompt is cut at other places."""
    path = ckpts["float32"]
    prompts = hc.prompts(lens=(3, 40, 200, 64), seed=5)
    sp = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    kw = dict(num_speculative_tokens=2, prefix_snapshot_interval=32, max_num_batched_tokens=48)
    with LLM(path, dtype="float32", mamba_ssm_cache_dtype="bfloat16", **kw) as llm:
        runs = [llm.generate(prompt_token_ids=prompts, sampling_params=sp) for _ in range(2)]
        assert llm.engine.blocks.num_free == llm.capacity().num_blocks
    assert sum(o.num_cached_tokens for o in runs[1]) > 0, "the repeat was meant to resume from snapshots"
    least, most = BOUNDS[("float32", "bfloat16")]
    for outs in runs:
        short = torch.cat([hc.hf_logit_shortfall(path, p, o.output_token_ids) for p, o in zip(prompts, outs)])
        assert (short <= 1e-4).float().mean().item() >= least and short.max().item() <= most


def test_bf16_state_at_tp2_gives_tp1_tokens(ckpts):
    """Each rank holds its value heads' state in bfloat16; seen equal to TP 1 token for token
    (the all-reduce's float32 order could in principle tip a bfloat16 rounding)."""
    prompts = hc.prompts(lens=(3, 40, 200, 64), seed=5)
    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    toks = []
    for tp in (1, 2):
        with LLM(ckpts["float32"], dtype="float32", mamba_ssm_cache_dtype="bfloat16", tensor_parallel_size=tp) as llm:
            toks.append([o.output_token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)])
    assert toks[1] == toks[0]

"""Images and the bfloat16 recurrent state on a CUDA device (needs a GPU).

Images: the vision encoder, M-RoPE positions and per-chunk embedding substitution on CUDA,
float32 greedy, token for token against transformers' `generate` on the same device and the same
processed inputs (tests/helpers/vl_ckpt.py), dense and MoE, with chunks that split an image.
State: `--mamba-ssm-cache-dtype bfloat16` on CUDA keeps test_ssm_dtype.py's CPU bound on top-1
agreement with transformers (teacher-forced on the same device), plain and with drafts."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.test_ssm_dtype import BOUNDS
from tests.helpers import hybrid_ckpt as hc
from tests.helpers import vl_ckpt as vc

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

DEVICE = "cuda"
NEW = 16


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_images_float32_greedy_equal_transformers(tmp_path, arch):
    path = vc.make(tmp_path / "ckpt", vc.SPEC_VL[arch])
    cases = {name: vc.case(path, name) for name in vc.CASES}
    refs = {name: vc.hf_greedy(path, ids, imgs, NEW, device=DEVICE) for name, (ids, imgs) in cases.items()}
    sp = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    with LLM(path, dtype="float32", device=DEVICE, max_num_batched_tokens=32) as llm:
        outs = llm.generate(
            prompt_token_ids=[c[0] for c in cases.values()], images=[c[1] for c in cases.values()], sampling_params=sp
        )
    for name, o in zip(cases, outs):
        assert o.output_token_ids == refs[name], f"{name}: the engine on CUDA diverges from transformers on CUDA"


@pytest.mark.parametrize("drafts", [0, 2], ids=["plain", "drafts2"])
def test_bf16_state_keeps_its_bound(tmp_path, drafts):
    from dataclasses import replace

    path = hc.make(tmp_path / "f32", replace(hc.SPEC_BF16, dtype="float32"))
    prompts = hc.prompts(lens=(3, 40, 200, 64), seed=5)
    sp = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    kw = dict(num_speculative_tokens=drafts) if drafts else {}
    with LLM(path, dtype="float32", device=DEVICE, mamba_ssm_cache_dtype="bfloat16", engine_process=False, **kw) as llm:
        pools = llm.engine.executor.worker.pools
        assert pools.recurrent[0].dtype == torch.bfloat16 and pools.recurrent[0].device.type == DEVICE
        toks = [o.output_token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)]
    short = torch.cat([hc.hf_logit_shortfall(path, p, t, device=DEVICE) for p, t in zip(prompts, toks)])
    agree = (short <= 1e-4).float().mean().item()
    least, most = BOUNDS[("float32", "bfloat16")]
    assert agree >= least, f"top-1 agreement {agree:.3f} < {least} on CUDA"
    assert short.max().item() <= most, f"a token {short.max().item():.4f} below transformers' max (bound {most})"

"""The tiny vision-language checkpoints: written by transformers' own classes with the image
processor beside them, and served text-only by the engine token for token as transformers does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import hybrid_ckpt as hc
from tests.helpers import vl_ckpt as vc


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_vl_checkpoint_text_only_matches_transformers(tmp_path, arch):
    path = vc.make(tmp_path / "ckpt", vc.SPEC_VL[arch])
    cfg = json.loads((Path(path) / "config.json").read_text())
    assert cfg["architectures"][0].endswith("ForConditionalGeneration")
    assert cfg["image_token_id"] == vc.token(path, "image") < cfg["text_config"]["vocab_size"]
    proc = vc.processor(path)
    assert (proc.patch_size, proc.temporal_patch_size, proc.merge_size) == (16, 2, 2)
    prompt = hc.prompts(vocab=600, lens=(23,), seed=4)[0]
    got = hc.engine_greedy(path, [prompt], 12)[0]
    assert got == vc.hf_greedy(path, prompt, [], 12)

"""Tiny checkpoints for the engine tests and the transformers reference outputs."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from engine.tiny_model import TinyModelSpec, make_tiny_model

# Hv = 2 Hk (the Qwen3.5 shape) and Hv = Hk.
SPEC_HV2 = TinyModelSpec(layers=8, linear_key_heads=4, linear_value_heads=8, tokenizer=False, seed=0)
SPEC_HV1 = TinyModelSpec(
    layers=8, linear_key_heads=4, linear_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=48,
    tokenizer=False, seed=1,
)
PROMPT_LENS = (1, 2, 3, 63, 64, 65, 200)

# MoE: odd sizes that still split over 8 ranks; 6 experts, top-3, one KV head; Qwen3-Next has a
# dense layer (0) among sparse ones and does not renormalise its top-k weights.
_MOE = dict(layers=4, hidden=64, heads=8, kv_heads=1, head_dim=16, linear_key_heads=8, linear_value_heads=16,
            linear_key_head_dim=8, linear_value_head_dim=8, vocab=320, intermediate=48, experts=6, top_k=3,
            moe_intermediate=24, shared_intermediate=40, tokenizer=False)
SPEC_MOE = {
    "qwen3_5_moe": TinyModelSpec(arch="qwen3_5_moe", seed=3, **_MOE),
    "qwen3_next": TinyModelSpec(arch="qwen3_next", seed=4, mlp_only_layers="0", norm_topk_prob=False, **_MOE),
}
MOE_PROMPT_LENS = (1, 5, 17, 40)


def make(path, spec: TinyModelSpec) -> str:
    return str(make_tiny_model(path, spec))


def prompts(vocab: int = 1024, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


@functools.lru_cache(maxsize=4)
def _hf_model(path: str, cls_name: str | None = None):
    """transformers' own model class for the checkpoint: `cls_name`, or its config's architecture."""
    import transformers

    cls_name = cls_name or json.loads((Path(path) / "config.json").read_text())["architectures"][0]
    return getattr(transformers, cls_name).from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: str, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' own generate, one prompt at a time (no padding), greedy."""
    model = _hf_model(path)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


def hf_last_logits(path: str, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return _hf_model(path)(torch.tensor([prompt])).logits[0, -1].float()


def hf_greedy_violations(path: str, prompt: list[int], tokens: list[int], tol: float = 1e-4) -> list[int]:
    """Positions where `tokens` is not transformers' greedy choice, checked teacher-forced: one
    full forward over prompt + tokens, and at every position the token must be the argmax, or
    within `tol` of it (a near-tie, which the order of float sums may decide either way).

    For long generations this is the reference to use: transformers' own cached `generate` can
    part from its full forward after a few hundred tokens (seen at token 162 of a 40-token
    prompt with the serve-test checkpoint, with a top-2 gap of 0.04 on the forward)."""
    with torch.inference_mode():
        lg = _hf_model(path)(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :].float()
    t = torch.tensor(tokens)
    short = lg.max(-1).values - lg.gather(1, t[:, None])[:, 0]
    return [k for k in (short > tol).nonzero().flatten().tolist()]

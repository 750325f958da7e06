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
    layers=8,
    linear_key_heads=4,
    linear_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=48,
    tokenizer=False,
    seed=1,
)
# with a multi-token-prediction block (`mtp.*` under the published names), for MTP drafting
SPEC_MTP = TinyModelSpec(layers=4, tokenizer=False, seed=2, mtp=True)
PROMPT_LENS = (1, 2, 3, 63, 64, 65, 200)
# bfloat16: weights drawn wider than the default (std 0.1), so that most positions have a clear argmax
SPEC_BF16 = TinyModelSpec(
    linear_key_head_dim=64, linear_value_head_dim=64, init_std=0.1, dtype="bfloat16", tokenizer=False, seed=0
)

# MoE: odd sizes that still split over 8 ranks; 6 experts, top-3, one KV head; Qwen3-Next has a
# dense layer (0) among sparse ones and does not renormalise its top-k weights.
_MOE = dict(
    layers=4,
    hidden=64,
    heads=8,
    kv_heads=1,
    head_dim=16,
    linear_key_heads=8,
    linear_value_heads=16,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    vocab=320,
    intermediate=48,
    experts=6,
    top_k=3,
    moe_intermediate=24,
    shared_intermediate=40,
    tokenizer=False,
)
SPEC_MOE = {
    "qwen3_5_moe": TinyModelSpec(arch="qwen3_5_moe", seed=3, **_MOE),
    "qwen3_next": TinyModelSpec(arch="qwen3_next", seed=4, mlp_only_layers="0", norm_topk_prob=False, **_MOE),
}
MOE_PROMPT_LENS = (1, 5, 17, 40)


def make(path, spec: TinyModelSpec) -> str:
    return str(make_tiny_model(path, spec))


def with_rope(src: str, dst: Path, rope: dict) -> str:
    """A copy of checkpoint `src` at `dst` whose config.json's rope_parameters has `rope` written in
    (the reference for a checkpoint served with those fields given as an override)."""
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["rope_parameters"].update(rope)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def prompts(vocab: int = 1024, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def engine_greedy(path, prompts: list[list[int]], new_tokens: int, **llm_kw) -> list[list[int]]:
    """The engine's float32 greedy tokens for each prompt; every KV page and state slot is free after."""
    from engine import LLM, SamplingParams

    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    with LLM(str(path), dtype="float32", **llm_kw) as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
        assert llm.engine.blocks.num_free == llm.capacity().num_blocks
        assert llm.engine.slots.num_free == llm.capacity().num_state_slots
    return [o.output_token_ids for o in outs]


@functools.lru_cache(maxsize=4)
def _hf_model(path: str, cls_name: str | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """transformers' own model class for the checkpoint: `cls_name`, or its config's architecture."""
    import transformers

    cls_name = cls_name or json.loads((Path(path) / "config.json").read_text())["architectures"][0]
    return getattr(transformers, cls_name).from_pretrained(path, dtype=dtype).to(device).eval()


# (path, prompt, dtype, device) -> the longest greedy continuation computed so far
_GREEDY: dict[tuple, list[int]] = {}


def hf_greedy(
    path: str, prompt: list[int], new_tokens: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> list[int]:
    """transformers' own generate, one prompt at a time (no padding), greedy.

    Kept for the session per checkpoint path and prompt: a shorter call is the first tokens of a
    longer one (`min_new_tokens` bans EOS over the same first steps either way), so the longest
    continuation asked for answers every shorter one. Checkpoints are never rewritten in place."""
    key = (str(path), tuple(prompt), dtype, str(device))
    have = _GREEDY.get(key)
    if have is None or len(have) < new_tokens:
        model = _hf_model(path, dtype=dtype, device=device)
        ids = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
            )
        have = _GREEDY[key] = out[0, len(prompt) :].tolist()
    return have[:new_tokens]


def hf_biased_greedy(path: str, prompt: list[int], new_tokens: int, bias: dict[int, float]) -> list[int]:
    """transformers' own generate, greedy, with its additive bias on single tokens (`sequence_bias`)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = _hf_model(path).generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            sequence_bias={(t,): b for t, b in bias.items()},
        )
    return out[0, len(prompt) :].tolist()


def hf_last_logits(path: str, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return _hf_model(path)(torch.tensor([prompt])).logits[0, -1].float()


def hf_greedy_violations(
    path: str, prompt: list[int], tokens: list[int], tol: float = 1e-4, dtype: torch.dtype = torch.float32
) -> list[int]:
    """Positions where `tokens` is not transformers' greedy choice, checked teacher-forced: one
    full forward over prompt + tokens, and at every position the token must be the argmax, or
    within `tol` of it (a near-tie, which the order of float sums may decide either way).

    For long generations this is the reference to use: transformers' own cached `generate` can
    part from its full forward after a few hundred tokens (seen at token 162 of a 40-token
    prompt with the serve-test checkpoint, with a top-2 gap of 0.04 on the forward)."""
    short = hf_logit_shortfall(path, prompt, tokens, dtype)
    return [k for k in (short > tol).nonzero().flatten().tolist()]


def hf_logit_shortfall(
    path: str, prompt: list[int], tokens: list[int], dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> torch.Tensor:
    """[len(tokens)]: how far below transformers' max logit each token is, teacher-forced (one
    full forward over prompt + tokens); 0 where the token is the argmax."""
    with torch.inference_mode():
        ids = torch.tensor([prompt + tokens[:-1]], device=device)
        lg = _hf_model(path, dtype=dtype, device=device)(ids).logits[0, len(prompt) - 1 :].float().cpu()
    t = torch.tensor(tokens)
    return lg.max(-1).values - lg.gather(1, t[:, None])[:, 0]


def first_step_drafts(llm, prompt: list[int], params) -> tuple[int, list[int]]:
    """One engine step on a new request: its first token and the drafts left for its next step."""
    rid = llm.engine.add_request(prompt, params)
    req = llm.engine.requests[rid]
    llm.engine.step()
    return req.output_token_ids[0], list(req.draft_token_ids)


def mtp_run(llm, prompt: list[int], params):
    """One request through an MTP engine to its end: the request, (tokens so far, first draft)
    after every step that left it drafts, and the MTP layer's KV [len(prompt), 2, KVH, hd] over
    the prompt."""
    e = llm.engine
    req = e.requests[e.add_request(prompt, params)]
    blocks: list[int] = []
    seen: list[tuple[int, int]] = []
    while e.has_unfinished():
        blocks = list(req.block_ids) or blocks
        e.step()
        if req.draft_token_ids and req.status.value == "running":
            seen.append((len(prompt) + len(req.output_token_ids), req.draft_token_ids[0]))
    pool = e.executor.worker.pools.kv[llm.config.model.num_layers]  # [blocks, 2, KVH, bs, hd]
    kv = torch.cat([pool[b] for b in blocks], dim=2)[:, :, : len(prompt)].permute(2, 0, 1, 3).clone()
    return req, seen, kv


def hf_mtp_logits(
    path: str, tokens: list[int], extra: list[tuple[int, torch.Tensor]] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """The published MTP block composed from transformers' own modules (RMSNorm, Linear, a
    full-attention Qwen3.5 decoder layer) with the checkpoint's `mtp.*` weights.

    Position p pairs the main model's final-normed hidden state at p with token p + 1 of
    `tokens`; `extra` appends (token, hidden) pairs (a recursive draft step: the previous draft
    and the block's own output). Returns (logits [P, V], block outputs [P, H]) at every position."""
    from safetensors.torch import load_file

    from engine.tiny_model import load_mtp_tensors, mtp_modules

    model = _hf_model(path)
    mods = mtp_modules(model.config)
    weights = {}
    for f in sorted(__import__("pathlib").Path(path).glob("*.safetensors")):
        weights.update({k: v for k, v in load_file(str(f)).items() if k.startswith("mtp.")})
    load_mtp_tensors(mods, weights)
    for mod in mods.values():
        mod.float().eval()
    with torch.inference_mode():
        ids = torch.tensor([tokens])
        hidden = model.model(ids).last_hidden_state[0, :-1]  # after the final norm
        nxt = ids[0, 1:]
        if extra:
            nxt = torch.cat([nxt, torch.tensor([t for t, _ in extra])])
            hidden = torch.cat([hidden, torch.stack([h for _, h in extra])])
        e = mods["pre_fc_norm_embedding"](model.model.embed_tokens(nxt))
        x = mods["fc"](torch.cat([e, mods["pre_fc_norm_hidden"](hidden)], dim=-1))[None]
        n = x.shape[1]
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        x = mods["layers.0"](
            x, position_embeddings=model.model.rotary_emb(x, pos), attention_mask=mask, position_ids=pos
        )
        if isinstance(x, tuple):
            x = x[0]
        out = mods["norm"](x)[0]
        return model.lm_head(out).float(), out


def make_fitted_mtp(path, spec: TinyModelSpec, fit_prompts: list[list[int]], length: int = 64, steps: int = 40) -> str:
    """A checkpoint whose `mtp.*` block was fitted (engine/tiny_model.py `fit_mtp_block`) to the
    model's own greedy continuations of `fit_prompts`, each continued to `length` tokens by the
    engine without speculation: on those prompts its drafts are mostly accepted, so verification
    takes its accept paths as well as its rollbacks (a random block's drafts are all rejected).
    The tests still compare with transformers' tokens. Any of the tiny architectures (an MoE
    block's router and experts are fitted too)."""
    from engine import LLM, SamplingParams
    from engine.tiny_model import fit_mtp_block

    out = make(path, spec)
    with LLM(out, dtype="float32") as llm:
        seqs = []
        for p in fit_prompts:
            sp = SamplingParams(max_tokens=length - len(p), temperature=0.0, ignore_eos=True)
            seqs.append(p + llm.generate(prompt_token_ids=[p], sampling_params=sp)[0].output_token_ids)
    fit_mtp_block(out, seqs, steps=steps, batch=len(seqs))
    return out

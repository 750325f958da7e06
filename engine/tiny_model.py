"""`pdserve make-tiny-model`: a small random checkpoint of any supported architecture written by
transformers' own classes, with a byte-level BPE tokenizer trained here; optionally FP8
block-quantized as the releases store it, or with an MTP block. The one place the engine imports
transformers' modeling code."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engine.tiny_template import CHAT_TEMPLATE, CHAT_TEMPLATE_JSON_CALLS, SPECIAL_TOKENS, TEXT_TOKENS, VISION_TOKENS

_CORPUS = """
Hybrid language models mix linear attention layers with full attention layers. A gated delta
network keeps a fixed-size recurrent state per request, while full attention keeps a key and
value cache that grows with every token. Serving such a model well means moving both kinds of
state from the prefill workers to the decode workers without a copy too many.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Hello world! How are you today? I am fine, thank you. What is the capital of France? Paris.
Once upon a time there was a small model that wanted to generate text very quickly.
The router picks a decode node, reserves memory, and sends the prompt to a prefill node.
Tokens stream back to the client one at a time until the request stops or reaches its limit.
0 1 2 3 4 5 6 7 8 9 10 100 1000 , . ; : ! ? ( ) [ ] { } < > = + - * / _ " ' # @ & %
"""


ARCHS = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}
VL_ARCHS = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
# Left unquantized by fp8 as released (besides 1-D tensors, conv1d, embeddings, lm_head, vision)
FP8_KEEP = (
    "mlp.gate",
    "mlp.shared_expert_gate",
    "linear_attn.in_proj_b",
    "linear_attn.in_proj_a",
    "linear_attn.in_proj_ba",
    "mtp.fc",
)


# the shape's sizes and counts that cannot be 0
_AT_LEAST_ONE = (
    "layers hidden intermediate heads kv_heads head_dim linear_key_heads linear_value_heads linear_key_head_dim "
    "linear_value_head_dim conv_kernel full_attention_interval vocab max_positions"
).split()


@dataclass(frozen=True)
class TinyModelSpec:
    arch: Literal["qwen3_5", "qwen3_5_moe", "qwen3_next"] = "qwen3_5"
    layers: int = 8
    hidden: int = 256
    intermediate: int = 512
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    linear_key_heads: int = 4
    linear_value_heads: int = 8
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 32
    conv_kernel: int = 4
    full_attention_interval: int = 4
    vocab: int = 1024
    max_positions: int = 4096
    seed: int = 0
    dtype: str = "float32"
    init_std: float = 0.02
    tokenizer: bool = True
    experts: int = 6  # routed experts per MoE layer (qwen3_5_moe, qwen3_next)
    top_k: int = 3
    moe_intermediate: int = 64
    shared_intermediate: int = 96
    mlp_only_layers: str = ""  # qwen3_next: comma-separated layers with a dense MLP of `intermediate`
    decoder_sparse_step: int = 1  # qwen3_next: layer i is MoE when (i + 1) % step == 0
    norm_topk_prob: bool = True  # qwen3_next (qwen3_5_moe always renormalises)
    fp8: bool = False  # store projections block-quantized to float8_e4m3fn with weight_scale_inv
    fp8_block: int = 128  # the [fp8_block, fp8_block] quantization block
    mtp: bool = False  # also write a multi-token-prediction block (`mtp.*`, one layer)
    vision: bool = False  # the vision-language model (qwen3_5 / qwen3_5_moe): a vision tower and its processor
    vision_depth: int = 2
    vision_hidden: int = 64
    vision_heads: int = 4
    vision_intermediate: int = 128
    vision_grid: int = 8  # the learned position grid is vision_grid x vision_grid
    mrope_section: str = "4,2,2"  # t,h,w rotary frequencies (interleaved): rotary_dim / 2 in all
    min_pixels: int = 32 * 32 * 4  # the processor's resize bounds (small, so tests stay fast)
    max_pixels: int = 32 * 32 * 64

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"unknown arch {self.arch!r}; known: {', '.join(ARCHS)}")
        for name in _AT_LEAST_ONE:  # a checkpoint with none of them loads nowhere
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(self, name)})")
        if self.vision and self.arch not in VL_ARCHS:
            raise ValueError(f"--vision needs one of {', '.join(VL_ARCHS)} (got {self.arch!r})")
        if self.vision and not self.tokenizer:
            raise ValueError("--vision needs the tokenizer (its vision token ids)")


FILL_VOCAB = 32_000  # from this size on, every id below the added tokens decodes to text


def _filled(tok, size: int):
    """The trained BPE with word tokens ("Ġw<id>", a space and a word) up to `size` ids, as a
    published tokenizer of that size has: a model drawing any id streams text (no merges make
    them, so encoding is unchanged)."""
    import json

    from tokenizers import Tokenizer

    spec = json.loads(tok.to_str())
    v = spec["model"]["vocab"]
    for i in range(len(v), size):
        v[f"\u0120w{i}"] = i
    return Tokenizer.from_str(json.dumps(spec))


def _train_tokenizer(vocab: int):
    """Byte-level BPE of `vocab` tokens: the special ones, the trained ones, then Qwen's added
    tokens (engine/tiny_template.py) at the top, all below `vocab`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - len(TEXT_TOKENS) - len(VISION_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    if vocab >= FILL_VOCAB:
        tok = _filled(tok, vocab - len(TEXT_TOKENS) - len(VISION_TOKENS))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_TOKENS])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    return tok


def _vl_config(spec: TinyModelSpec, text, tok):
    """The vision-language wrapper around text config `text`: a small vision tower whose merger
    outputs the text model's hidden size, the vision token ids from the tokenizer, and the text
    model's interleaved multimodal rotary sections."""
    import transformers

    text.rope_parameters = {
        **(text.rope_parameters or {}),
        "mrope_section": [int(x) for x in spec.mrope_section.split(",")],
        "mrope_interleaved": True,
    }
    vision = dict(
        depth=spec.vision_depth,
        hidden_size=spec.vision_hidden,
        num_heads=spec.vision_heads,
        intermediate_size=spec.vision_intermediate,
        out_hidden_size=spec.hidden,
        num_position_embeddings=spec.vision_grid * spec.vision_grid,
        patch_size=16,
        temporal_patch_size=2,
        spatial_merge_size=2,
        initializer_range=spec.init_std,
    )
    ids = {f"{n}_token_id": tok.token_to_id(f"<|{n}|>") for n in ("vision_start", "vision_end")}
    cls = transformers.Qwen3_5Config if spec.arch == "qwen3_5" else transformers.Qwen3_5MoeConfig
    return cls(
        text_config=text.to_dict(),
        vision_config=vision,
        image_token_id=tok.token_to_id("<|image_pad|>"),
        video_token_id=tok.token_to_id("<|video_pad|>"),
        tie_word_embeddings=False,
        **ids,
    )


def _perturb_vision(visual, seed: int) -> None:
    """Random LayerNorm scales and biases in the vision tower (transformers initialises them to
    ones and zeros), so a reader that swaps or drops one is caught."""
    import torch

    g = torch.Generator().manual_seed(seed + 13)
    with torch.no_grad():
        for name, p in visual.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                base = 1.0 if "norm" in name and name.endswith(".weight") else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))


def save_image_processor(out: Path, spec: TinyModelSpec) -> None:
    """preprocessor_config.json as Qwen3.5 releases ship it (mean and std 0.5, patch 16, temporal
    patch 2, merge 2), with the spec's small pixel bounds."""
    from transformers import Qwen2VLImageProcessorPil

    Qwen2VLImageProcessorPil(
        size={"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    ).save_pretrained(out)


def _config(spec: TinyModelSpec, eos):
    import transformers

    common = dict(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        linear_num_key_heads=spec.linear_key_heads,
        linear_num_value_heads=spec.linear_value_heads,
        linear_key_head_dim=spec.linear_key_head_dim,
        linear_value_head_dim=spec.linear_value_head_dim,
        linear_conv_kernel_dim=spec.conv_kernel,
        full_attention_interval=spec.full_attention_interval,
        max_position_embeddings=spec.max_positions,
        initializer_range=spec.init_std,
        eos_token_id=eos,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    moe = dict(
        num_experts=spec.experts,
        num_experts_per_tok=spec.top_k,
        moe_intermediate_size=spec.moe_intermediate,
        shared_expert_intermediate_size=spec.shared_intermediate,
    )
    if spec.arch == "qwen3_5":
        return transformers.Qwen3_5TextConfig(intermediate_size=spec.intermediate, **common)
    if spec.arch == "qwen3_5_moe":
        return transformers.Qwen3_5MoeTextConfig(**moe, **common)
    only = [int(i) for i in spec.mlp_only_layers.split(",") if i.strip()]
    return transformers.Qwen3NextConfig(
        intermediate_size=spec.intermediate,
        mlp_only_layers=only,
        decoder_sparse_step=spec.decoder_sparse_step,
        norm_topk_prob=spec.norm_topk_prob,
        **moe,
        **common,
    )


def _quantizable(name: str, shape) -> bool:
    if (
        len(shape) != 2
        or not name.endswith(".weight")
        or "embed_tokens" in name
        or name.startswith("lm_head")
        or ".visual." in "." + name
    ):
        return False
    module = name.removesuffix(".weight")
    return not any(module.endswith(k) for k in FP8_KEEP)


def quantize_checkpoint_fp8(out: Path, block: int) -> None:
    """Rewrite a save_pretrained checkpoint's projections as FP8 blocks with `*_scale_inv`
    (module docstring), in place, shard by shard."""
    import torch
    from safetensors.torch import load_file, save_file

    from kernels.fp8 import quant_fp8_block

    files = sorted(out.glob("*.safetensors"))
    index = out / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    for f in files:
        tensors = load_file(f)
        for name in [n for n, t in tensors.items() if _quantizable(n, t.shape)]:
            q, scale = quant_fp8_block(tensors[name], (block, block))
            tensors[name], tensors[name + "_scale_inv"] = q, scale.to(torch.bfloat16)  # as released
            if weight_map is not None:
                weight_map[name + "_scale_inv"] = f.name
        save_file(tensors, f, metadata={"format": "pt"})
    if weight_map is not None:
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
        "modules_to_not_convert": ["lm_head", "embed_tokens", "norm", "conv1d", "visual", *FP8_KEEP],
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def make_tiny_model(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    import torch
    import transformers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    eos = None
    tok = None
    if spec.tokenizer:
        least = 256 + len(SPECIAL_TOKENS) + len(TEXT_TOKENS) + len(VISION_TOKENS)
        if spec.vocab < least:
            raise ValueError(f"vocab {spec.vocab} is too small for a byte-level tokenizer (needs >= {least})")
        tok = _train_tokenizer(spec.vocab)
        eos = tok.token_to_id("<|endoftext|>")
    cfg = _config(spec, eos)
    arch = ARCHS[spec.arch]
    if spec.vision:
        cfg, arch = _vl_config(spec, cfg, tok), VL_ARCHS[spec.arch]
    torch.manual_seed(spec.seed)
    model = getattr(transformers, arch)(cfg).to(getattr(torch, spec.dtype))
    if spec.vision:
        _perturb_vision(model.model.visual, spec.seed)
    model.save_pretrained(out)
    if spec.vision:
        save_image_processor(out, spec)
    if spec.mtp:
        add_mtp_block(out, cfg, spec.seed, getattr(torch, spec.dtype))
    if spec.fp8:
        quantize_checkpoint_fp8(out, spec.fp8_block)
    if tok is not None:
        template = CHAT_TEMPLATE_JSON_CALLS if spec.arch == "qwen3_next" else CHAT_TEMPLATE  # as published
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", chat_template=template
        )
        fast.save_pretrained(out)
    (out / "pdserve_tiny.json").write_text(json.dumps(spec.__dict__, indent=2))
    return out


def mtp_modules(cfg):
    """transformers' own modules shaped as the published MTP block: (norms, fc, decoder layer).
    The decoder layer is a full-attention layer of the model's own class, with its MLP (the
    sparse MoE block for Qwen3.5-MoE and Qwen3-Next)."""
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer

    layer_cls = {
        "qwen3_5_text": Qwen3_5DecoderLayer,
        "qwen3_5_moe_text": Qwen3_5MoeDecoderLayer,
        "qwen3_next": Qwen3NextDecoderLayer,
    }[cfg.model_type]

    full = cfg.layer_types.index("full_attention")
    h = cfg.hidden_size
    return {
        "pre_fc_norm_embedding": Qwen3_5RMSNorm(h, eps=cfg.rms_norm_eps),
        "pre_fc_norm_hidden": Qwen3_5RMSNorm(h, eps=cfg.rms_norm_eps),
        "fc": torch.nn.Linear(2 * h, h, bias=False),
        "layers.0": layer_cls(cfg, full),
        "norm": Qwen3_5RMSNorm(h, eps=cfg.rms_norm_eps),
    }


def mtp_tensors(mods: dict) -> dict:
    """The block's modules (`mtp_modules`) as checkpoint tensors under the published names: an MoE
    layer's experts one by one (`mtp.layers.0.mlp.experts.E.{gate,up,down}_proj.weight`, as the
    main layers are saved and the published MoE checkpoints ship them), not transformers' stacked
    `experts.gate_up_proj` / `experts.down_proj` parameters."""
    out = {}
    for prefix, mod in mods.items():
        for name, p in mod.state_dict().items():
            key = f"mtp.{prefix}.{name}"
            if name == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
                base, inter = key.removesuffix("gate_up_proj"), p.shape[1] // 2
                for e in range(p.shape[0]):
                    out[f"{base}{e}.gate_proj.weight"] = p[e, :inter]
                    out[f"{base}{e}.up_proj.weight"] = p[e, inter:]
            elif name == "mlp.experts.down_proj":  # [E, H, I]
                base = key.removesuffix("down_proj")
                for e in range(p.shape[0]):
                    out[f"{base}{e}.down_proj.weight"] = p[e]
            else:
                out[key] = p
    return out


def load_mtp_tensors(mods: dict, weights: dict) -> None:
    """Load checkpoint tensors (`mtp_tensors`' names, per-expert or stacked) into the modules."""
    import torch

    for prefix, mod in mods.items():
        head = f"mtp.{prefix}."
        sd = {n[len(head) :]: w.float() for n, w in weights.items() if n.startswith(head)}
        experts = "mlp.experts."
        n_exp = len({n.split(".")[2] for n in sd if n.startswith(experts) and n.split(".")[2].isdigit()})
        if n_exp:
            one = [[sd.pop(f"{experts}{e}.{w}_proj.weight") for e in range(n_exp)] for w in ("gate", "up", "down")]
            sd[experts + "gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(one[0], one[1])])
            sd[experts + "down_proj"] = torch.stack(one[2])
        mod.load_state_dict(sd)


def add_mtp_block(out_dir: str | Path, cfg, seed: int, dtype) -> None:
    """Add random `mtp.*` tensors under the published names to the checkpoint written by
    save_pretrained, and `mtp_num_hidden_layers: 1` to its config.json (to its `text_config` in a
    vision-language checkpoint, as the releases have it; the block's tensors are `mtp.*` there too,
    beside `model.language_model.*`). Norm weights are random too (not zero), so a reader that
    gets the (1 + w) convention wrong is caught."""
    import torch
    from safetensors.torch import load_file, save_file

    out = Path(out_dir)
    g = torch.Generator().manual_seed(seed + 7)
    cfg = cfg.get_text_config()
    mods = mtp_modules(cfg)
    with torch.no_grad():
        for prefix, mod in mods.items():
            for name, p in mod.state_dict(keep_vars=True).items():
                std = 0.1 if "norm" in f"{prefix}.{name}" else cfg.initializer_range
                p.copy_(torch.randn(p.shape, generator=g) * std)
    tensors = {n: w.detach().to(dtype).contiguous() for n, w in mtp_tensors(mods).items()}
    files = sorted(out.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"expected one safetensors file in {out}, found {len(files)}")
    weights = load_file(str(files[0]))
    weights.update(tensors)
    save_file(weights, str(files[0]), metadata={"format": "pt"})
    cfg_path = out / "config.json"
    raw = json.loads(cfg_path.read_text())
    raw.get("text_config", raw)["mtp_num_hidden_layers"] = 1
    cfg_path.write_text(json.dumps(raw, indent=2))


def fit_mtp_block(
    path: str | Path,
    seqs=None,
    steps: int = 300,
    num_seqs: int = 64,
    seq_len: int = 64,
    batch: int = 8,
    lr: float = 3e-3,
    seed: int = 0,
    log=None,
) -> float:
    """Fit the checkpoint's `mtp.*` block (fc, norms, decoder layer; embedding and LM head frozen)
    to the model's own greedy choices, and write it back in place.

    The block at position p sees (the final-normed hidden state at p, token p + 1) and should
    propose what the model's greedy step takes after token p + 1: the argmax of its logits at
    p + 1. That is what verification accepts, whatever the tokens before, so the pairs come from
    one forward pass over the sequences: `seqs` (equal-length token lists, e.g. prompts with
    the model's greedy continuations), else `num_seqs` random ones of `seq_len`. Adam over
    `batch` sequences a step on the CPU; returns the training accuracy of the block's argmax at
    the last step."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    out = Path(path)
    arch = json.loads((out / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(out, dtype=torch.float32).eval()
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    if seqs is None:
        seqs = torch.randint(0, cfg.vocab_size, (num_seqs, seq_len), generator=g)
    seqs = torch.as_tensor(seqs)
    num_seqs, batch = seqs.shape[0], min(batch, seqs.shape[0])
    with torch.inference_mode():
        last = model.model(seqs).last_hidden_state  # after the final norm
        greedy = model.lm_head(last).argmax(-1)[:, 1:]  # the model's choice after token p + 1
        hidden = last[:, :-1]  # at p
        embed_next = model.model.embed_tokens(seqs[:, 1:])  # token p + 1
    hidden, embed_next, greedy = hidden.clone(), embed_next.clone(), greedy.clone()
    mods = mtp_modules(cfg)
    files = sorted(out.glob("*.safetensors"))
    weights = load_file(str(files[0]))
    load_mtp_tensors(mods, weights)
    for mod in mods.values():
        mod.float().train()
    opt = torch.optim.Adam([p for m in mods.values() for p in m.parameters()], lr=lr)
    lm_head = model.lm_head.weight.detach()
    n = hidden.shape[1]
    pos = torch.arange(n)[None].expand(batch, n)
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    rope = model.model.rotary_emb(hidden[:batch], pos)
    acc = 0.0
    for step in range(steps):
        idx = torch.randint(0, num_seqs, (batch,), generator=g)
        e = mods["pre_fc_norm_embedding"](embed_next[idx])
        x = mods["fc"](torch.cat([e, mods["pre_fc_norm_hidden"](hidden[idx])], dim=-1))
        x = mods["layers.0"](x, position_embeddings=rope, attention_mask=mask, position_ids=pos)
        logits = mods["norm"](x[0] if isinstance(x, tuple) else x) @ lm_head.T
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), greedy[idx].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            acc = float((logits.argmax(-1) == greedy[idx]).float().mean())
            if log is not None:
                log(f"step {step}: loss {loss.item():.3f}, batch accuracy {acc:.3f}")
    dtype = next(iter(weights.values())).dtype
    weights.update({n: p.detach().to(dtype).contiguous() for n, p in mtp_tensors(mods).items()})
    save_file(weights, str(files[0]), metadata={"format": "pt"})
    return acc

"""`pdserve make-tiny-model`: a small random Qwen3.5 checkpoint written by transformers' own
`Qwen3_5ForCausalLM(...).save_pretrained`, plus a byte-level BPE tokenizer trained here on a
built-in text, loadable with `AutoTokenizer.from_pretrained(DIR)` and no download.

This is a tool, not the serving path: it is the one place the engine package imports
transformers' modeling code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
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


@dataclass(frozen=True)
class TinyModelSpec:
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
    mtp: bool = False  # also write a multi-token-prediction block (`mtp.*`, one layer)


def _train_tokenizer(vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tok


def make_tiny_model(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    eos = None
    tok = None
    if spec.tokenizer:
        if spec.vocab < 256 + len(SPECIAL_TOKENS):
            raise ValueError(f"vocab {spec.vocab} is too small for a byte-level tokenizer (needs >= 259)")
        tok = _train_tokenizer(spec.vocab)
        eos = tok.token_to_id("<|endoftext|>")
    cfg = Qwen3_5TextConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
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
    torch.manual_seed(spec.seed)
    model = Qwen3_5ForCausalLM(cfg).to(getattr(torch, spec.dtype))
    model.save_pretrained(out)
    if spec.mtp:
        add_mtp_block(out, cfg, spec.seed, getattr(torch, spec.dtype))
    if tok is not None:
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
        )
        fast.save_pretrained(out)
    (out / "pdserve_tiny.json").write_text(json.dumps(spec.__dict__, indent=2))
    return out


def mtp_modules(cfg):
    """transformers' own modules shaped as the published MTP block: (norms, fc, decoder layer).
    The decoder layer is a full-attention Qwen3.5 layer with the model's MLP."""
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

    full = cfg.layer_types.index("full_attention")
    h = cfg.hidden_size
    return {
        "pre_fc_norm_embedding": Qwen3_5RMSNorm(h, eps=cfg.rms_norm_eps),
        "pre_fc_norm_hidden": Qwen3_5RMSNorm(h, eps=cfg.rms_norm_eps),
        "fc": torch.nn.Linear(2 * h, h, bias=False),
        "layers.0": Qwen3_5DecoderLayer(cfg, full),
        "norm": Qwen3_5RMSNorm(h, eps=cfg.rms_norm_eps),
    }


def add_mtp_block(out_dir: str | Path, cfg, seed: int, dtype) -> None:
    """Add random `mtp.*` tensors under the published names to the checkpoint written by
    save_pretrained, and `mtp_num_hidden_layers: 1` to its config.json. Norm weights are random
    too (not zero), so a reader that gets the (1 + w) convention wrong is caught."""
    import torch
    from safetensors.torch import load_file, save_file

    out = Path(out_dir)
    g = torch.Generator().manual_seed(seed + 7)
    tensors = {}
    for prefix, mod in mtp_modules(cfg).items():
        for name, p in mod.state_dict().items():
            std = 0.1 if "norm" in f"{prefix}.{name}" else cfg.initializer_range
            w = torch.randn(p.shape, generator=g) * std
            tensors[f"mtp.{prefix}.{name}"] = w.to(dtype).contiguous()
    files = sorted(out.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"expected one safetensors file in {out}, found {len(files)}")
    weights = load_file(str(files[0]))
    weights.update(tensors)
    save_file(weights, str(files[0]), metadata={"format": "pt"})
    cfg_path = out / "config.json"
    raw = json.loads(cfg_path.read_text())
    raw["mtp_num_hidden_layers"] = 1
    cfg_path.write_text(json.dumps(raw, indent=2))

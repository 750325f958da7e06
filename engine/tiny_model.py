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
    if tok is not None:
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
        )
        fast.save_pretrained(out)
    (out / "pdserve_tiny.json").write_text(json.dumps(spec.__dict__, indent=2))
    return out

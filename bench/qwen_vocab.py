"""A byte-level BPE tokenizer with Qwen's vocabulary size (151,936 ids) for benchmarks: no real
tokenizer can be downloaded here, so its tokens are made up (syllable words and their prefixes,
with and without a leading blank, capitals, digits, JSON punctuation runs, indentation), each
with the merge that builds it, deterministic. Id 0 is
<|endoftext|>. `write_tokenizer(dir)` writes tokenizer.json and tokenizer_config.json there."""

from __future__ import annotations

import json
import random
from pathlib import Path

VOCAB = 151_936
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_C = "bcdfghjklmnprstvwz"
_V = "aeiou"
_P = '{}[]":,.-_/()'


class _Vocab:
    """Tokens in id order with the BPE merges that build them: every token of two or more
    characters is the merge of two earlier tokens, so the tokenizer's own encoding uses them."""

    def __init__(self, alphabet: list[str]):
        self.ids: dict[str, int] = {}
        self.merges: list[tuple[str, str]] = []
        for a in alphabet:
            self.ids.setdefault(a, len(self.ids))

    def add(self, w: str, cut: int | None = None) -> None:
        if w in self.ids:
            return
        k = cut if cut is not None else len(w) // 2
        left, right = w[:k], w[k:]
        self.add(left)
        self.add(right)
        self.merges.append((left, right))
        self.ids[w] = len(self.ids)


def _vocab(n: int, seed: int = 0) -> _Vocab:
    from tokenizers import pre_tokenizers

    rng = random.Random(seed)
    v = _Vocab(SPECIAL + sorted(pre_tokenizers.ByteLevel.alphabet()))
    for d in range(1000):
        v.add(str(d))
    for k in range(2, 5):
        for _ in range(300):
            v.add("".join(rng.choice(_P) for _ in range(k)))
    for k in range(2, 17):
        v.add("Ġ" * k)
        v.add("Ċ" + "Ġ" * (k - 1), 1)
    while len(v.ids) < n:
        syl = [
            rng.choice(_C) + rng.choice(_V) + (rng.choice(_C) if rng.random() < 0.4 else "")
            for _ in range(rng.randint(1, 4))
        ]
        if rng.random() < 0.15:
            syl[0] = syl[0].capitalize()
        for i in range(len(syl)):  # every prefix of the word, with and without a leading blank
            w = "".join(syl[: i + 1])
            v.add(w, len(w) - len(syl[i]) or None)
            if rng.random() < 0.6 and len(v.ids) < n:
                v.add("Ġ" + w, 1)
    while len(v.ids) > n:  # the last word's tokens past n: drop them
        w, _ = v.ids.popitem()
        v.merges = [m for m in v.merges if m[0] + m[1] != w]
    return v


def write_tokenizer(out_dir: str | Path, vocab: int = VOCAB) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    v = _vocab(vocab)
    tok = Tokenizer(models.BPE(vocab=v.ids, merges=v.merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)  # already ids 0, 1, 2 of the model: marked special
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": SPECIAL[0]}))
    return out

"""The checkpoint's tokenizer, through the `tokenizers` library (tokenizer.json), if it has one."""

from __future__ import annotations

import functools
import json
from pathlib import Path


class Tokenizer:
    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _T

        self._tok = _T.from_file(str(Path(path) / "tokenizer.json"))
        cfg = Path(path) / "tokenizer_config.json"
        self.config = json.loads(cfg.read_text()) if cfg.is_file() else {}
        # a Jinja2 string: tokenizer_config.json's `chat_template`, or chat_template.jinja (newer checkpoints)
        tmpl = Path(path) / "chat_template.jinja"
        ct = self.config.get("chat_template")
        if isinstance(ct, list):  # named templates: [{"name": "default", "template": ...}, ...]
            ct = next((t.get("template") for t in ct if t.get("name") == "default"), None)
        self.chat_template: str | None = ct or (tmpl.read_text() if tmpl.is_file() else None)
        self._bytes: tuple[dict[str, int] | None, dict[int, tuple[str, bool]]] | None = None  # token_bytes'

    @functools.cached_property
    def added_tokens(self) -> dict[str, int]:
        """The added tokens' texts (`<tool_call>`, `<|im_end|>`) and ids: llguidance reads each as
        a special token that a grammar names by id (`<[151657]>`), not as the text it spells."""
        return {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}

    @staticmethod
    def exists(path: str | Path) -> bool:
        return (Path(path) / "tokenizer.json").is_file()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    # `encode` and `decode` hold the GIL while they work; the batch calls release it, so these are
    # what a thread off an event loop calls (a 2 MB text takes seconds to encode).
    def encode_released(self, text: str) -> list[int]:
        """`encode(text)`, releasing the GIL while the tokenizer works."""
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def decode_released(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """`decode(ids)`, releasing the GIL while the tokenizer works."""
        return self._tok.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes | None:
        """The bytes token_id stands for in decoded text (an added token: its content's UTF-8; a
        special one skipped: none), or None for a tokenizer that is not byte-level (its tokens
        are no byte strings)."""
        if self._bytes is None:
            self._bytes = _byte_table(self._tok)
        table, added = self._bytes
        if token_id in added:
            content, special = added[token_id]
            return b"" if special and skip_special_tokens else content.encode()
        if table is None:
            return None
        piece = self._tok.id_to_token(token_id)
        return b"" if piece is None else bytes(table[c] for c in piece if c in table)

    def vocab_size(self) -> int:
        """Ids the tokenizer knows, its added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)


def message_break(path: str | Path) -> tuple[int, ...]:
    """The token ids between two messages of a ChatML prompt (Qwen's: `<|im_end|>`, a newline,
    `<|im_start|>`), where the prefix cache saves a snapshot (docs/prefix-caching.md); () when
    the checkpoint has no tokenizer or no such tokens."""
    if not Tokenizer.exists(path):
        return ()
    tok = Tokenizer(path)
    end, start = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|im_start|>")
    newline = tok.encode("\n")
    if end is None or start is None or len(newline) != 1:
        return ()
    return (end, newline[0], start)


def _byte_table(tok) -> tuple[dict[str, int] | None, dict[int, tuple[str, bool]]]:
    """(character -> byte of a byte-level BPE's alphabet, or None when the decoder is not
    byte-level; added token id -> (content, special)). The alphabet: each byte that prints as
    itself (33-126, 161-172, 174-255) is its own character; the others, in byte order, are
    256, 257, ..."""
    added = {i: (t.content, bool(t.special)) for i, t in tok.get_added_tokens_decoder().items()}
    if type(tok.decoder).__name__ != "ByteLevel":
        return None, added
    shown = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table = {chr(b): b for b in shown}
    rest = (b for b in range(256) if b not in table.values())
    table.update({chr(256 + k): b for k, b in enumerate(rest)})
    return table, added

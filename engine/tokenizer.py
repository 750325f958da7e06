"""The checkpoint's tokenizer, through the `tokenizers` library (tokenizer.json), if it has one."""

from __future__ import annotations

import json
from pathlib import Path


class Tokenizer:
    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _T

        self._tok = _T.from_file(str(Path(path) / "tokenizer.json"))
        cfg = Path(path) / "tokenizer_config.json"
        self.config = json.loads(cfg.read_text()) if cfg.is_file() else {}

    @staticmethod
    def exists(path: str | Path) -> bool:
        return (Path(path) / "tokenizer.json").is_file()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

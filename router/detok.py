"""Incremental detokenization: text deltas for a stream of token ids.

Decoding each new token alone breaks multi-byte characters and merged pieces, and decoding the
whole output every time is quadratic. Keep a short window: decode ids[prefix:] and ids[prefix:read]
and emit the difference; hold back while the tail is an incomplete character (U+FFFD).
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, context_ids: list[int] = (), skip_special_tokens: bool = True):
        self.tok = tokenizer
        # special tokens (<|im_end|>) left out of the text, or decoded too (the request's choice)
        self.kw = {} if skip_special_tokens else {"skip_special_tokens": False}
        self.ids: list[int] = list(context_ids[-4:])  # a little prompt context for leading spaces
        self.prefix = 0
        self.read = len(self.ids)

    def push(self, new_ids: list[int], final: bool = False) -> str:
        self.ids.extend(new_ids)
        before = self.tok.decode(self.ids[self.prefix : self.read], **self.kw)
        after = self.tok.decode(self.ids[self.prefix :], **self.kw)
        if after.endswith("\ufffd") and not final:
            return ""
        delta = after[len(before) :]
        self.prefix, self.read = self.read, len(self.ids)
        return delta

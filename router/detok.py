"""Incremental detokenization: text deltas for a stream of token ids.

Decoding each new token alone breaks multi-byte characters and merged pieces, and decoding the
whole output every time is quadratic. Keep a short window: decode ids[prefix:] and ids[prefix:read]
and emit the difference, less a trailing incomplete character (U+FFFD), which waits for the tokens
that complete it. What has been emitted after any pushes is the text of all the ids pushed (less
such a tail), however they were split into pushes: a stream resumed elsewhere (the SDK on its
next router) primes a new detokenizer with one push of the tokens its client has and goes on
with no text lost or repeated.
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
        self.sent = 0  # characters of the window's delta emitted while its tail was incomplete

    def push(self, new_ids: list[int], final: bool = False) -> str:
        self.ids.extend(new_ids)
        before = self.tok.decode(self.ids[self.prefix : self.read], **self.kw)
        after = self.tok.decode(self.ids[self.prefix :], **self.kw)
        delta = after[len(before) :]
        ready = delta if final else delta.rstrip("\ufffd")
        out = ready[self.sent :]
        if len(ready) == len(delta):  # nothing waits: the window moves on
            self.prefix, self.read, self.sent = self.read, len(self.ids), 0
        else:
            self.sent = max(self.sent, len(ready))
        return out

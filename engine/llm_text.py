"""The offline LLM's text stop strings (`SamplingParams.stop`), as vLLM's offline API applies them:
each request's output is detokenized as its tokens come, one token at a time, and the first
token whose text completes a stop string ends it: the text stops right before the string (or
after it, with `include_stop_str_in_output`), the tokens after that one are dropped, the request
is aborted in the engine, and it finishes with reason "stop" and the string as its stop_reason.
As with stop_token_ids, matching starts once the output has `min_tokens` tokens."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer


@dataclass
class Stopped:
    """Where a stop string ended a request."""

    keep: int  # output tokens kept (up to the one whose text completed the match)
    text: str  # the output text, cut at the match
    stop: str  # the stop string matched


class TextWatch:
    """One request's output text as its tokens come (incremental detokenization: each token's
    text is the growth of a short window's text, held back while it ends in a partial UTF-8
    character), searched for its stop strings from where the last search could still match."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams):
        self.tok = tokenizer
        self.stops = [s for s in params.stop if s]
        self.include = params.include_stop_str_in_output
        self.skip = params.skip_special_tokens
        self.min_tokens = params.min_tokens
        self.ids: list[int] = []
        self.text = ""
        self.prefix = self.read = 0  # the window's start, and the end of the tokens already in `text`
        self.searched = 0  # characters of `text` a match could no longer start before (but for its own length)

    def push(self, token_ids: list[int]) -> Stopped | None:
        """Take new tokens; a Stopped at the first that completes a stop string, else None."""
        for t in token_ids:
            self.ids.append(t)
            self.text += self._next()
            if len(self.ids) < self.min_tokens:
                self.searched = len(self.text)
                continue
            hit = self._find()
            if hit is not None:
                return hit
        return None

    def _next(self) -> str:
        before = self.tok.decode(self.ids[self.prefix : self.read], skip_special_tokens=self.skip)
        now = self.tok.decode(self.ids[self.prefix :], skip_special_tokens=self.skip)
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""  # no whole character yet
        self.prefix, self.read = self.read, len(self.ids)
        return now[len(before) :]

    def _find(self) -> Stopped | None:
        best: tuple[int, int] | None = None  # (start, -length): the first match, the longest there
        for s in self.stops:
            i = self.text.find(s, max(0, self.searched - len(s) + 1))
            if i >= 0 and (best is None or (i, -len(s)) < best):
                best = (i, -len(s))
        self.searched = len(self.text)
        if best is None:
            return None
        i, n = best[0], -best[1]
        return Stopped(len(self.ids), self.text[: i + n if self.include else i], self.text[i : i + n])

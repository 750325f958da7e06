"""One HTTP request's choices, shaped as OpenAI answers them: a `Job` (one GenerateRequest per
choice: n per prompt, choice j * n + i is sample i of prompt j) and a `Choice` per request that
collects its chunks into a whole answer or turns each into a stream delta.

`echo` puts the prompt before the output, and with logprobs the prompt's logprobs before the
output's (the first prompt token has none). Logprobs are shaped as completions'
(`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) or chat's
(`content: [{token, logprob, bytes, top_logprobs}]`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from proto import pb
from router.detok import IncrementalDetokenizer
from router.images.prepare import Prepared
from router.parsers.output import ChatOutput
from router.request import Chunk
from router.stops import held_back


@dataclass
class Job:
    """One HTTP request: a GenerateRequest per choice, and how to shape the answer."""

    model: str
    chat: bool
    id: str
    n: int  # choices per prompt
    no_output: bool  # max_tokens 0: the one token generated is not returned
    logprobs: int | None  # alternatives per position, when logprobs were asked for
    reqs: list[pb.GenerateRequest] = field(default_factory=list)  # per choice, in choice order
    echoes: list[str | None] = field(default_factory=list)  # per choice: with echo, its prompt's text
    typed: list[bool] = field(default_factory=list)  # per choice: its prompt was sent as text (echoed as written)
    prompt_ids: list[list[int]] = field(default_factory=list)  # per choice: its prompt's ids, when sent as ids
    created: int = field(default_factory=lambda: int(time.time()))
    output: Callable[[], ChatOutput] | None = None  # chat: each choice's output parsers
    images: list[Prepared] = field(default_factory=list)  # chat: the prompt's images, decoded once for every choice
    token_ids: bool = False  # return_token_ids: the prompt's and each choice's token ids in the answer
    ids_as_text: bool = False  # return_tokens_as_token_ids: logprobs name tokens "token_id:N"
    chat_echo: str = ""  # chat `echo`: the text each choice's content starts with (openai_chat.echoed)
    prompt_logprobs: int | None = None  # vLLM's `prompt_logprobs`: alternatives per prompt token

    def head(self, chunk: bool) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {
            "id": ("chatcmpl-" if self.chat else "cmpl-") + self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
        }


class Choice:
    """One choice's text, tokens and logprobs as its chunks arrive."""

    def __init__(self, job: Job, index: int, tok):
        self.job, self.index, self.tok = job, index, tok
        self.text: list[str] = []
        self.entries: list = []  # pb.TokenLogprob per returned token; echo: the prompt's first
        self.n = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.finish: str | None = None
        self.stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it
        self.offset = 0  # completions text_offset of the next token
        self._echoed = 0  # logprob entries of the echoed prompt
        self._shaped = 0  # logprob entries shaped so far
        self.started = False
        self.out = job.output() if job.output is not None else None
        self.prompt_ids: list[int] = []  # the prompt the nodes got (return_token_ids)
        self.ids: list[int] = []  # the tokens returned (return_token_ids)
        self.prompt_lps: list | None = None  # vLLM's prompt_logprobs, from the first chunk

    def _take(self, c: Chunk) -> tuple[str, list]:
        """The text and logprob entries this chunk adds (echo: the prompt's on the first)."""
        text, entries = "", []
        if not self.started:
            self.started = True
            self.prompt_tokens, self.cached_tokens = c.prompt_tokens, c.cached_tokens
            self.prompt_ids = list(c.prompt_token_ids)
            echo, ids = self.job.echoes[self.index], self.job.prompt_ids[self.index]
            if self.job.prompt_logprobs is not None:
                self.prompt_lps = self._prompt_logprobs(c.prompt_logprobs, self.job.prompt_logprobs)
            if echo is not None:
                text = echo
                if self.job.logprobs is not None and ids:  # NaN: the first token has no logprob
                    entries = [pb.TokenLogprob(token_id=ids[0], logprob=float("nan"))]
                    for e in c.prompt_logprobs:  # computed with max(logprobs, prompt_logprobs) alternatives
                        entries.append(
                            pb.TokenLogprob(token_id=e.token_id, logprob=e.logprob, top=e.top[: self.job.logprobs])
                        )
                    self._echoed = len(entries)
        if not self.job.no_output:
            text += c.text
            entries += list(c.logprobs)
            self.n += len(c.token_ids)
            if self.job.token_ids:
                self.ids += c.token_ids
        self.finish = c.finish_reason or self.finish
        if c.finish_reason == "stop":  # a stop string, else one of the request's stop ids (not EOS: None)
            ids = self.job.reqs[self.index].sampling.stop_token_ids
            self.stop_reason = c.stop or (c.token_ids[-1] if c.token_ids and c.token_ids[-1] in ids else None)
        return text, entries

    def add(self, c: Chunk) -> None:
        text, entries = self._take(c)
        self.text.append(text)
        self.entries += entries
        if self.out is not None:
            self.out.push(text, final=bool(c.finish_reason), tokens=self._new(c))

    def replay(self, token_ids: list[int], finished: bool, prompt: list[int]) -> None:
        """A resumed answer (ChatRequest.resume): the tokens its client already has go through
        this choice's parsers and counts without being sent, so its stream goes on from their
        state; a finished choice is not continued. Its prompt is counted here (its cached tokens
        as none: the first router had them)."""
        req = self.job.reqs[self.index]
        sp = req.sampling
        skip = not sp.HasField("skip_special_tokens") or sp.skip_special_tokens
        text = IncrementalDetokenizer(self.tok, prompt, skip).push(token_ids, final=finished)
        if not finished and len(token_ids) >= sp.min_tokens:  # as the client has it: less a held stop's start
            text = text[: len(text) - len(held_back(text, list(sp.stop)))]
        self.n += len(token_ids)
        if self.job.token_ids:
            self.ids += token_ids
        if self.out is not None:
            self.out.push(text, finished, len(token_ids))
        self.text.append(text)
        if token_ids or finished:  # its stream's first chunk, with the prompt's figures, was sent already
            self.started, self.prompt_tokens = True, len(prompt)

    def _new(self, c: Chunk) -> int:
        """The chunk's tokens the answer counts."""
        return 0 if self.job.no_output else len(c.token_ids)

    def _finish(self, fin: str | None) -> str | None:
        """finish_reason: "tool_calls" when the output ended on its own after calls, not inside one
        (a stop string matched in a call's text: "stop", its arguments cut short as with "length")."""
        return "tool_calls" if fin == "stop" and self.out is not None and self.out.calls_done else fin

    def whole(self) -> dict:
        out = {"index": self.index, "finish_reason": self._finish(self.finish), "stop_reason": self.stop_reason}
        lp = self._logprobs(self.entries) if self.job.logprobs is not None else None
        if self.job.chat:
            msg = self.out.message() if self.out is not None else None
            msg = msg or {"role": "assistant", "content": "".join(self.text)}
            if self.job.chat_echo:
                msg = dict(msg, content=self.job.chat_echo + (msg.get("content") or ""))
            out["message"] = msg
            out["logprobs"] = lp
        else:
            out.update(text="".join(self.text), logprobs=lp)
            if self.job.token_ids:
                out["prompt_token_ids"] = self.prompt_ids
            if self.job.prompt_logprobs is not None:
                out["prompt_logprobs"] = self.prompt_lps
        if self.job.token_ids:
            out["token_ids"] = self.ids
        return out

    def delta(self, c: Chunk) -> dict | None:
        """The stream delta of this chunk; None when it adds nothing. A chunk with new tokens is an
        event even when their text is held back (an incomplete character, the start of a possible
        stop string): each token reaches the client in the step it is made, its text follows."""
        first = not self.started
        text, entries = self._take(c)
        ended = bool(c.finish_reason)
        out = self.out
        fields = out.push(text, ended, self._new(c)) if out is not None else {"content": text} if text else {}
        if first and self.job.chat_echo:  # the choice's first delta opens with the echoed text
            fields = dict(fields, content=self.job.chat_echo + (fields.get("content") or ""))
        fin = self._finish(c.finish_reason or None)
        if not fields and not entries and fin is None and not self._new(c):
            return None
        lp = self._logprobs(entries) if self.job.logprobs is not None else None
        if self.job.chat:
            d = {"index": self.index, "delta": fields, "logprobs": lp, "finish_reason": fin}
        else:
            d = {"index": self.index, "text": text, "logprobs": lp, "finish_reason": fin}
            if self.job.token_ids and first:
                d["prompt_token_ids"] = self.prompt_ids
            if self.job.prompt_logprobs is not None and first:
                d["prompt_logprobs"] = self.prompt_lps
        if fin is not None:
            d["stop_reason"] = self.stop_reason
        if self.job.token_ids:
            d["token_ids"] = [] if self.job.no_output else list(c.token_ids)
        return d

    def _prompt_logprobs(self, entries, k: int) -> list[dict[str, dict] | None]:
        """vLLM's prompt_logprobs: None for the first prompt token, then per token {id: {logprob,
        rank, decoded_token}}, the prompt's token first and the k most likely after it (ranks
        1..k); each id decoded alone, special tokens kept, as vLLM's; -inf as vLLM clamps it."""
        out: list[dict[str, dict] | None] = [None]
        for e in entries:
            d = {str(e.token_id): self._plp(e.token_id, e.logprob, e.rank or None)}
            for r, t in enumerate(e.top[:k], 1):
                d.setdefault(str(t.token_id), self._plp(t.token_id, t.logprob, r))
            out.append(d)
        return out

    def _plp(self, token_id: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": max(logprob, -9999.0), "rank": rank, "decoded_token": self._str(token_id, False)}

    def _skip(self) -> bool:
        """Whether the entry about to be shaped skips special tokens as its text does: an echoed
        prompt sent as text holds them as written; ids are decoded as the request says."""
        if self._shaped < self._echoed:
            return not (self.index < len(self.job.typed) and self.job.typed[self.index])
        sp = self.job.reqs[self.index].sampling
        return not sp.HasField("skip_special_tokens") or sp.skip_special_tokens

    def _str(self, token_id: int, skip: bool) -> str:
        return f"token_id:{token_id}" if self.job.ids_as_text else self.tok.decode([token_id], skip)

    def _bytes(self, token_id: int, skip: bool) -> bytes:
        raw = self.tok.token_bytes(token_id, skip)
        return raw if raw is not None else self.tok.decode([token_id], skip).encode()

    def _at(self, token_id: int, skip: bool) -> int:
        """completions' text_offset of the token, into `text`: the characters before it, by its
        bytes (a token that ends a character others began is at that character)."""
        raw = self.tok.token_bytes(token_id, skip)
        if raw is None:  # not byte-level: its decoded text's length
            at, self.offset = self.offset, self.offset + len(self.tok.decode([token_id], skip))
            return at
        at = self.offset - 1 if raw and raw[0] & 0xC0 == 0x80 and self.offset else self.offset
        self.offset += sum(b & 0xC0 != 0x80 for b in raw)
        return at

    def _logprobs(self, entries) -> dict:
        if self.job.chat:

            def one(t, lp, skip):
                return {"token": self._str(t, skip), "logprob": lp, "bytes": list(self._bytes(t, skip))}

            content = []
            for e in entries:
                skip = self._skip()
                self._shaped += 1
                tops = [one(t.token_id, t.logprob, skip) for t in e.top]
                content.append(dict(one(e.token_id, e.logprob, skip), top_logprobs=tops))
            return {"content": content}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            skip = self._skip()
            self._shaped += 1
            first = e.logprob != e.logprob  # NaN marks the prompt's first token: no logprob
            out["tokens"].append(self._str(e.token_id, skip))
            out["token_logprobs"].append(None if first else e.logprob)
            # the N most likely and, as OpenAI's, the token itself (up to N + 1 entries); ids whose
            # texts are the same share a key, which keeps the likeliest of them
            top: dict[str, float] | None = None
            if not first:
                top = {}
                for t_id, t_lp in [(t.token_id, t.logprob) for t in e.top] + [(e.token_id, e.logprob)]:
                    key = self._str(t_id, skip)
                    top[key] = max(t_lp, top.get(key, t_lp))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self._at(e.token_id, skip))
        return out


def usage(choices: list[Choice]) -> dict:
    groups: dict[int, list[Choice]] = {}  # the choices of each prompt, whose prompt counts once
    for c in choices:
        groups.setdefault(c.index // c.job.n, []).append(c)
    firsts = [next((c for c in cs if c.started), cs[0]) for cs in groups.values()]
    p, cached = sum(c.prompt_tokens for c in firsts), sum(c.cached_tokens for c in firsts)
    n = sum(c.n for c in choices)
    out = {
        "prompt_tokens": p,
        "completion_tokens": n,
        "total_tokens": p + n,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    parsed = [c.out for c in choices if c.out is not None and c.out.reasoning is not None]
    if parsed:  # tokens generated inside the think block (router/parsers/output.py)
        out["completion_tokens_details"] = {"reasoning_tokens": sum(o.reasoning_tokens for o in parsed)}
    return out

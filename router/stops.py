"""Text stop sequences (`SamplingParams.stop`), matched on the detokenized output in the router.

The text a request streams ends right before the first occurrence of any stop string, and the
request then finishes with reason "stop" (the decode node's work is cancelled). Text that could
be the start of a match (a suffix of what has been decoded that is a prefix of a stop string)
is held back until more text shows it is not, so a client never sees part of a stop string,
even one split across several tokens. As with min_tokens for stop token ids, matching starts
once the request has min_tokens new tokens. With `include` (SamplingParams
include_stop_str_in_output) the matched string stays at the end of the text. A stream resumed
on another router (the SDK's resume) starts its matcher holding what the first router held
(`held_back` of the text the client's tokens make), so that text is sent once, and a stop string
split across the move still matches.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

MAX_STOPS = 64  # stop strings per request at most (docs/api.md): their matching runs on the router's loop
MAX_STOP_CHARS = 256  # characters per stop string at most


def check_stops(stops: list[str]) -> None:
    """ValueError saying why (opening with `stop`) when `stops` is past the bounds: beyond them the
    matcher's work per chunk, on the router's event loop, would slow every other stream."""
    if len(stops) > MAX_STOPS:
        raise ValueError(f"stop has {len(stops):,} strings; at most {MAX_STOPS}")
    for i, s in enumerate(stops):
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(f"stop[{i}] has {len(s):,} characters; at most {MAX_STOP_CHARS} per stop string")


def _tail(buf: str, s: str, lo: int) -> int:
    """The longest tail of `buf`, starting at `lo` or later, that is a prefix of `s`."""
    p = buf.find(s[0], lo)
    while p >= 0:
        if s.startswith(buf[p:]):
            return len(buf) - p
        p = buf.find(s[0], p + 1)
    return 0


class StopMatcher:
    """Each stop string's tail (the longest end of the text that begins it) is kept: the next
    chunk's search for it starts there, so a chunk costs the stop strings' count times its own
    length plus the tails it drops (as with KMP), not the stop strings' length each time."""

    def __init__(self, stops: list[str], include: bool = False, held: str = ""):
        self.stops = [s for s in stops if s]
        self.include = include
        self.held = held  # text not sent yet: it may be the start of a stop string
        self.matched = ""  # the stop string that matched
        self.end = 0  # characters of the last pushed text up to the match's end (once matched)
        self.tails = [len(held)] * len(self.stops)  # at most each one's tail (a resumed matcher's: held)

    def push(self, text: str) -> tuple[str, bool]:
        """Add decoded text; returns (text safe to emit now, whether a stop string matched)."""
        h, buf = len(self.held), self.held + text
        # a match not seen before ends in `text`: it starts in its stop string's tail at the earliest
        hits = [(i, -len(s)) for s, t in zip(self.stops, self.tails) if (i := buf.find(s, h - t)) >= 0]
        if hits:  # the first match; of those starting there, the longest
            self.held = ""
            i, neg = min(hits)
            self.matched = buf[i : i - neg]
            self.end = i - neg - h
            return buf[: i - neg if self.include else i], True
        n, keep = len(buf), 0
        for j, s in enumerate(self.stops):  # each tail grows by `text` at most
            t = self.tails[j] = _tail(buf, s, n - min(len(s) - 1, self.tails[j] + len(text)))
            keep = max(keep, t)
        self.held = buf[n - keep :]
        return buf[: n - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        self.tails = [0] * len(self.stops)
        return held


def held_back(text: str, stops: list[str]) -> str:
    """The tail of `text` a matcher holds once it has seen it (however it came in pieces): the
    part of a resumed stream's text its client has not been sent."""
    m = StopMatcher(stops)
    _, hit = m.push(text)
    return "" if hit else m.held


async def with_stops(
    chunks: AsyncIterator,
    stops: list[str],
    min_tokens: int = 0,
    on_stop: Callable[[int], None] | None = None,
    include: bool = False,
    held: str = "",
) -> AsyncIterator:
    """Wrap a stream of chunks with text deltas (router/request.py `Chunk`): hold back and cut at
    stop strings; on a match, the chunk that completed it is the last one (finish_reason "stop")
    and `chunks` is closed, which cancels the request upstream; its tokens after the one that
    completed the match are dropped, and `on_stop` gets their count. `held`: text held back before
    the first chunk (a resumed stream's), sent before that chunk's own unless a stop matches."""
    if not [s for s in stops if s]:
        async for c in chunks:
            yield c
        return
    m = StopMatcher(list(stops), include, held)
    n = 0
    try:
        async for c in chunks:
            n += len(c.token_ids)
            if n < min_tokens:
                yield c
                continue
            text, hit = m.push(c.text)
            if hit:
                c.text, c.finish_reason, c.stop = text, "stop", m.matched
                dropped = _cut_after_match(c, m.end)
                if on_stop is not None:
                    on_stop(dropped)
                yield c
                return
            c.text = text + (m.flush() if c.finish_reason else "")
            yield c
    finally:
        await chunks.aclose()


def _cut_after_match(c, end: int) -> int:
    """Drop the chunk's tokens after the one whose text completes the match, `end` characters
    into the chunk's text: a step that accepted several drafts may have made tokens past it,
    which are not part of the output (its token ids, logprobs and usage end at that token).
    Returns how many were dropped."""
    if len(c.token_ids) < 2 or not c.token_text:
        return 0
    keep, seen = len(c.token_ids), 0
    for j, piece in enumerate(c.token_text):
        seen += len(piece)
        if seen >= end:
            keep = j + 1
            break
    if len(c.logprobs) == len(c.token_ids):
        c.logprobs = c.logprobs[:keep]
    dropped = len(c.token_ids) - keep
    c.token_ids, c.token_text = c.token_ids[:keep], c.token_text[:keep]
    return dropped

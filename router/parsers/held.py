"""Text that may be the start of a tag is held back: `safe_end(buf, tags)` is how much of `buf`
can be released now, the rest being a proper prefix of one of `tags` that the next text may
complete."""

from __future__ import annotations


def safe_end(buf: str, tags: tuple[str, ...]) -> int:
    """The end of the longest prefix of `buf` whose remainder cannot begin any of `tags`."""
    keep = 0
    for t in tags:
        for k in range(min(len(t) - 1, len(buf)), keep, -1):
            if buf.endswith(t[:k]):
                keep = k
                break
    return len(buf) - keep


def first(buf: str, tags: tuple[str, ...]) -> tuple[int, str]:
    """The earliest occurrence of any of `tags` in `buf`: (index, tag), or (-1, "")."""
    hits = [(i, t) for t in tags if (i := buf.find(t)) >= 0]
    return min(hits) if hits else (-1, "")

"""What each node's prefix cache holds, as the router sees it (`NodeCache`, from digests and what it
placed since), and how much of a prompt a node can take from it (`usable`), which depends on
whether the node computes the prompt or receives its state (docs/routing.md)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.prefix_hash import ROOT_HASH, page_name, prefix_key, prompt_hashes, salted, short
from engine.vision.inputs import hash_view

if TYPE_CHECKING:
    from proto import pb  # the wire stubs load on first use (tooling commands never load them)

RECENT_MAX = 16384  # names remembered per node (oldest dropped first)


class PrefixQuery:
    """A prompt's names under a node's page size, computed once per page size on first use. With
    images, the names are over the prompt's hash view (each image's placeholder run carrying its
    pixel hash, engine/vision/inputs.py) and, with a `cache_salt`, the first token salted
    (engine/prefix_hash.py `salted`), as the nodes name their pages."""

    def __init__(self, ids: list[int], images: Sequence[pb.ImageInput] = (), salt: str = ""):
        self.ids = salted(hash_view(ids, images) if images else ids, salt)
        self.prompt_len = len(ids)
        self._full: dict[int, list[int]] = {}  # block size -> 128-bit chained page hashes
        self._short: dict[tuple[int, bool], list[int]] = {}
        self._keys: dict[tuple[int, int], int] = {}

    def full_hashes(self, bs: int) -> list[int]:
        if bs not in self._full:
            self._full[bs] = prompt_hashes(self.ids, bs)
        return self._full[bs]

    def pages(self, bs: int, mtp: bool = False) -> list[int]:
        """The 64-bit names of the prompt's full pages (with MTP, each with the token after it;
        the prompt's last page, when it ends on one, with none: it never matches)."""
        if (bs, mtp) not in self._short:
            ids, n = self.ids, self.prompt_len
            self._short[(bs, mtp)] = [
                page_name(h, (ids[(j + 1) * bs] if (j + 1) * bs < n else -1) if mtp else None)
                for j, h in enumerate(self.full_hashes(bs))
            ]
        return self._short[(bs, mtp)]

    def key(self, bs: int, n: int) -> int:
        """The 64-bit name of a snapshot after the prompt's first n tokens."""
        k = self._keys.get((bs, n))
        if k is None:
            j = n // bs
            parent = self.full_hashes(bs)[j - 1] if j else ROOT_HASH
            k = self._keys[(bs, n)] = short(prefix_key(parent, self.ids[j * bs : n]))
        return k


@dataclass
class NodeCache:
    """One node's last digest plus what the router placed there since (`recent`, name -> expiry)."""

    version: int = -1
    block_size: int = 0  # 0: the node has no prefix cache
    interval: int = 0
    mtp: bool = False  # page names cover the token after each page (engine/prefix_hash.page_name)
    pages: set[int] = field(default_factory=set)
    snapshots: dict[int, set[int]] = field(default_factory=dict)  # prefix length -> snapshot names
    recent_pages: dict[int, float] = field(default_factory=dict)
    recent_snapshots: dict[tuple[int, int], float] = field(default_factory=dict)  # (length, name) -> expiry

    def update(self, d) -> None:
        """A node's PrefixDigest (proto); the same version again changes nothing."""
        if d.version == self.version and d.block_size == self.block_size:
            return
        self.version, self.block_size, self.interval = d.version, d.block_size, d.snapshot_interval
        self.mtp = d.mtp
        self.pages = set(d.pages)
        snaps: dict[int, set[int]] = {}
        for k, n in zip(d.snapshot_keys, d.snapshot_tokens, strict=True):
            snaps.setdefault(n, set()).add(k)
        self.snapshots = snaps

    def _has_page(self, h: int, now: float) -> bool:
        return h in self.pages or self.recent_pages.get(h, 0.0) > now

    def leading_pages(self, q: PrefixQuery, now: float | None = None) -> int:
        """How many of the prompt's leading full pages the node holds."""
        if not self.block_size:
            return 0
        now = time.monotonic() if now is None else now
        n = 0
        for h in q.pages(self.block_size, self.mtp):
            if not self._has_page(h, now):
                break
            n += 1
        return n

    def usable(self, q: PrefixQuery, compute: bool, now: float | None = None) -> int:
        """Prompt tokens the node can skip: computing the prompt (a snapshot at p and every full
        page before it, p < prompt length), or receiving its state (the leading full pages)."""
        bs = self.block_size
        if not bs:
            return 0
        now = time.monotonic() if now is None else now
        lead = self.leading_pages(q, now)
        if not compute:
            return lead * bs
        # the pages a snapshot at p needs: p // bs, with MTP (p - 1) // bs; all within the lead
        limit = min(q.prompt_len - 1, (lead + 1) * bs - (0 if self.mtp else 1))
        best = 0
        for n, keys in self.snapshots.items():
            if best < n <= limit and q.key(bs, n) in keys:
                best = n
        for (n, k), exp in self.recent_snapshots.items():
            if best < n <= limit and exp > now and q.key(bs, n) == k:
                best = n
        return best

    def remember(self, q: PrefixQuery, compute: bool, ttl_s: float, now: float | None = None) -> None:
        """The node was just given this prompt: it will hold its full pages and a snapshot at the
        prompt's end, and when it computes the prompt, snapshots on its grid too."""
        bs = self.block_size
        if not bs:
            return
        # computing it: snapshots on the grid and at its end; receiving it: at its end (a decode
        # node keeps the state that landed, PrefixPlanner.keep_landed), but not with MTP
        points = list(range(self.interval, q.prompt_len, self.interval)) if compute and self.interval else []
        ends = [*points, q.prompt_len] if compute or not self.mtp else []
        self._note(q.pages(bs, self.mtp), [(n, q.key(bs, n)) for n in ends], ttl_s, now)

    def remember_end(self, q: PrefixQuery, ttl_s: float, now: float | None = None) -> None:
        """A request placed here ended there (stop or length), `q` its prompt and output: the
        node keeps its final state, every token but the last (PrefixPlanner.keep_final), and
        the reply's full pages before it, which its next digest reports; known at once, so that
        the conversation's next turn sent right after finds them."""
        bs, n = self.block_size, q.prompt_len - 1
        if bs and n > 0:
            self._note(q.pages(bs, self.mtp)[: n // bs], [(n, q.key(bs, n))], ttl_s, now)

    def _note(self, pages: list[int], snaps: list[tuple[int, int]], ttl_s: float, now: float | None) -> None:
        now = time.monotonic() if now is None else now
        exp = now + ttl_s
        for h in pages:
            self.recent_pages.pop(h, None)  # re-inserted: the newest last
            self.recent_pages[h] = exp
        for k in snaps:
            self.recent_snapshots.pop(k, None)
            self.recent_snapshots[k] = exp
        for d in (self.recent_pages, self.recent_snapshots):  # in expiry order: the oldest first
            while d and (len(d) > RECENT_MAX or next(iter(d.values())) <= now):
                del d[next(iter(d))]

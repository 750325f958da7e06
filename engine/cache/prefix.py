"""Prefix caching for a hybrid model: full attention pages named by chained hashes and shared by
reference count, plus GDN state snapshots (conv + recurrent state and the partial page) saved on a
grid and at prompt ends. A request resumes from the longest prefix with a snapshot and every page
before it (docs/prefix-caching.md)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine.cache.block_manager import BlockManager
from engine.prefix_hash import ROOT_HASH, block_hash, page_name, prefix_key, prompt_hashes, short

__all__ = ["ROOT_HASH", "Digest", "PrefixCache", "PrefixHit", "Snapshot", "block_hash", "prompt_hashes"]

DIGEST_PAGES = 1024  # the most page hashes a digest carries (8 bytes each on the wire)
DIGEST_SNAPSHOTS = 256  # ... and snapshots (12 bytes each)


@dataclass(frozen=True)
class Digest:
    """What the cache holds, bounded, most recently used first, in the 64-bit names the router
    recomputes (engine/prefix_hash.py): reported with every heartbeat for cache-aware routing."""

    version: int  # changes whenever a page or snapshot is cached or evicted
    block_size: int
    interval: int  # the snapshot grid
    pages: tuple[int, ...] = ()  # engine/prefix_hash.page_name of each cached page
    snapshot_keys: tuple[int, ...] = ()  # prefix_key of each ready snapshot ...
    snapshot_tokens: tuple[int, ...] = ()  # ... and the prefix length it holds
    mtp: bool = False  # page names cover the token after each page; snapshots keep page p - 1


@dataclass
class PromptLogprobs:
    """The prompt logprobs a request computed up to a snapshot at p (engine/request.py entries,
    (token, logprob, top list)): entry i is token i + 1's. Entries 0 .. p - 2 depend on the prefix
    alone; entry p - 1, token p's, on token p too, so it is kept per token p seen."""

    num_top: int  # the top-list length of the entries (a request asking for more misses)
    prefix: list  # entries 0 .. p - 2
    next: dict[int, tuple]  # token p -> entry p - 1

    def entries(self, token: int, num_top: int) -> list:
        """Entries 0 .. p - 1 for a prompt whose token p is `token`, top lists cut to num_top."""
        return [(e[0], e[1], e[2][:num_top], *e[3:]) for e in [*self.prefix, self.next[token]]]


@dataclass(eq=False)
class Snapshot:
    index: int  # entry of the snapshot pool
    num_tokens: int  # the state after this many tokens
    parent: int  # hash of the full pages before num_tokens (ROOT_HASH: none)
    tail: tuple[int, ...]  # the tokens after them
    ref: int = 0  # steps reading (restore) or writing (save) it now; > 0: not evictable
    ready: bool = False  # written: lookups may use it
    cold: bool = False  # a grid point nobody has resumed from yet, or a superseded point: first out
    prompt_logprobs: PromptLogprobs | None = None  # kept by a request that asked for them
    end: bool = False  # a prompt's end (or a landed prompt's state): one conversation's point
    resumes: int = 0  # requests that have resumed from it
    final: bool = False  # a finished request's last state: its conversation's deepest point

    @property
    def tier(self) -> int:
        """Its place in the eviction order (PrefixCache.reserve): 0 cold, 1 a final state nobody
        has resumed from yet, 2 the rest (prompt ends, message and branch points, points resumed
        from)."""
        return 0 if self.cold else 1 if self.final and not self.resumes else 2


@dataclass
class PrefixHit:
    num_tokens: int  # tokens the request skips
    pages: list[int]  # the cached full pages it shares (`PrefixCache.shared_pages`)
    snapshot: Snapshot


@dataclass
class PrefixStats:
    query_tokens: int = 0  # prompt tokens of requests looked up (first admission only)
    hit_tokens: int = 0  # ... of which came from the cache
    saved: int = 0  # snapshots written
    evicted: int = 0  # snapshots dropped for newer ones
    held: int = 0  # requests whose admission waited for a running request's snapshot (inflight.py)


class PrefixCache:
    def __init__(
        self,
        blocks: BlockManager,
        num_snapshots: int,
        interval: int,
        mtp: bool = False,
        message_break: tuple[int, ...] = (),
    ):
        if interval < 1:
            raise ValueError(f"prefix snapshot interval must be >= 1 (got {interval})")
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.interval = interval
        self.message_break = message_break  # a snapshot before its last token too (`extra_points`)
        self.mtp = mtp  # the MTP drafter's KV is cached too (docs/ARCHITECTURE.md)
        self.num_snapshots = num_snapshots
        self._free_idx = list(range(num_snapshots - 1, -1, -1))
        self._by_key: dict[tuple[int, tuple[int, ...]], Snapshot] = {}
        self._by_parent: dict[int, list[Snapshot]] = {}
        self._lru: OrderedDict[Snapshot, None] = OrderedDict()  # ready, ref 0; oldest first
        self._cold: OrderedDict[Snapshot, None] = OrderedDict()  # ... grid points: evicted before those
        self._finals: OrderedDict[Snapshot, None] = OrderedDict()  # ... final states: between the two
        self.stats = PrefixStats()

    def _queues(self) -> tuple[OrderedDict[Snapshot, None], ...]:
        """The eviction order by tier (`Snapshot.tier`), each oldest first."""
        return self._cold, self._finals, self._lru

    @property
    def num_used(self) -> int:
        return self.num_snapshots - len(self._free_idx)

    @property
    def num_free(self) -> int:
        """Entries `reserve` can give without evicting any."""
        return len(self._free_idx)

    # ---- lookup ----------------------------------------------------------------------
    def shared_pages(self, p: int) -> int:
        """The cached full pages a request resuming at p shares; with MTP the page holding token
        p - 1 is not one of them, it comes from the snapshot (`tail_page`)."""
        return (p - 1) // self.block_size if self.mtp else p // self.block_size

    def message_points(self, tokens: list[int]) -> list[int]:
        """Prompt positions just before a message starts (the last token of each `message_break`):
        the first (a shared system prompt's end) and the last two (a conversation's branches)."""
        brk, n = self.message_break, len(self.message_break)
        points: list[int] = []
        i = 0
        while brk:
            try:
                i = tokens.index(brk[0], i)
            except ValueError:
                break
            if tuple(tokens[i : i + n]) == brk:
                points.append(i + n - 1)
            i += 1
        return sorted(set(points[:1] + points[-2:]))

    def tail_page(self, p: int) -> int | None:
        """Index of the page a snapshot at p keeps (the partial page; with MTP always the page of
        token p - 1, whose drafter KV a resuming request rewrites), None when it keeps none."""
        if self.mtp:
            return (p - 1) // self.block_size
        return p // self.block_size if p % self.block_size else None

    def lookup(
        self, tokens: list[int], hashes: list[int], limit: int, prompt_logprobs: int | None = None
    ) -> PrefixHit | None:
        """The longest usable prefix p <= limit of `tokens` (whose full-page hashes are
        `hashes`): a ready snapshot at p with the pages it does not hold cached (`shared_pages`);
        with MTP, each of those computed with this prompt's next token after it. A request with
        prompt logprobs (`prompt_logprobs` = its top-list length) takes only a snapshot that
        keeps them, for its token p and at least that many alternatives. Changes nothing."""
        bs = self.block_size
        best: Snapshot | None = None
        pages: list[int] = []
        parent = ROOT_HASH
        for j in range(len(hashes) + 1):
            base = j * bs
            for s in self._by_parent.get(parent, ()):
                if (
                    s.ready
                    and s.num_tokens <= limit
                    and self.shared_pages(s.num_tokens) <= len(pages)
                    and (best is None or s.num_tokens > best.num_tokens)
                    and tuple(tokens[base : s.num_tokens]) == s.tail
                    and (prompt_logprobs is None or self._has_prompt_logprobs(s, tokens, prompt_logprobs))
                ):
                    best = s
            if j == len(hashes) or base + bs > limit or len(pages) < j:
                break  # (with MTP, one level past a missing page: a snapshot at its end keeps it)
            after = (tokens[base + bs] if base + bs < len(tokens) else -1) if self.mtp else None
            page = self.blocks.lookup(hashes[j], after)
            if page is None and not self.mtp:
                break
            if page is not None:
                pages.append(page)
            parent = hashes[j]
        if best is None:
            return None
        return PrefixHit(best.num_tokens, pages[: self.shared_pages(best.num_tokens)], best)

    @staticmethod
    def _has_prompt_logprobs(s: Snapshot, tokens: list[int], num_top: int) -> bool:
        d = s.prompt_logprobs
        return d is not None and d.num_top >= num_top and tokens[s.num_tokens] in d.next

    def find(self, parent: int, tail: tuple[int, ...]) -> Snapshot | None:
        """The snapshot of this prefix, if one is kept (ready or being saved)."""
        return self._by_key.get((parent, tail))

    def keep_prompt_logprobs(self, s: Snapshot, num_top: int, entries: list, tokens: list[int]) -> None:
        """A request that asked for prompt logprobs has computed `entries` past s.num_tokens = p:
        keep those a request resuming at p needs (`PromptLogprobs`), unless s keeps more
        alternatives already."""
        p = s.num_tokens
        if p >= len(tokens) or len(entries) < p or p == 0:
            return
        d = s.prompt_logprobs
        if d is None or d.num_top < num_top:
            s.prompt_logprobs = PromptLogprobs(num_top, entries[: p - 1], {tokens[p]: entries[p - 1]})
        elif d.num_top == num_top:
            d.next[tokens[p]] = entries[p - 1]

    # ---- pins ------------------------------------------------------------------------
    def acquire(self, s: Snapshot) -> None:
        """Pin `s` for a request resuming from it. Resumed from, it earns its place, except a
        prompt's end or a final state at its first resume: that is the conversation's next turn,
        which saves its own longer end and final state, and a third turn resumes from those, so
        this one goes to the front of the eviction order (a second resume, a regenerated turn
        say, brings it back)."""
        s.ref += 1
        s.resumes += 1
        s.cold = (s.end or s.final) and s.resumes == 1
        for q in self._queues():
            q.pop(s, None)

    def release(self, s: Snapshot) -> None:
        if s.ref < 1:
            raise ValueError(f"snapshot {s.index} released more often than acquired")
        s.ref -= 1
        if s.ref == 0 and s.ready and self._by_key.get((s.parent, s.tail)) is s:
            self._queues()[s.tier][s] = None

    def supersede(self, s: Snapshot) -> None:
        """A deeper point of the same conversation was saved (a finished request's final state
        after its prompt's end): `s`, if nobody has resumed from it, goes cold, so that a pool
        short of entries keeps each conversation's deepest point before its intermediate ones."""
        if s.resumes or s.cold:
            return
        queued = [q for q in self._queues() if s in q]
        for q in queued:
            del q[s]
        s.cold = True
        if queued:
            self._cold[s] = None

    # ---- saving ----------------------------------------------------------------------
    def reserve(
        self,
        parent: int,
        tail: tuple[int, ...],
        num_tokens: int,
        cold: bool = False,
        end: bool = False,
        final: bool = False,
    ) -> Snapshot | None:
        """An entry to save the state after `num_tokens` tokens into (pinned until `commit`), or
        None: that prefix is saved already, or no entry is free or evictable for it. cold: a grid
        point inside a prompt, which joins the eviction order at its front until a request
        resumes from it. final: a finished request's last state (`keep_final`), next: a
        conversation's next turn resumes from it when its history keeps the reply id for id.
        end: a prompt's end (`acquire`). An entry evicts the oldest of the lowest tier
        (`Snapshot.tier`) and never one above its own: a running prompt's grid points take
        only other grid points, not the final state of the conversation that runs next (with
        three conversations taking turns on five entries, each turn's grid points evicted the
        others' final states and no turn after the second resumed at all)."""
        old = self._by_key.get((parent, tail))
        if old is not None:
            old.end = old.end or end
            if old.cold and not cold:  # a grid point that is now a prompt's end, say
                queued = old in self._cold
                self._cold.pop(old, None)
                old.cold, old.final = False, old.final or final
                if queued:
                    self._queues()[old.tier][old] = None
            if old in self._lru:
                self._lru.move_to_end(old)
            return None
        tier = 0 if cold else 1 if final else 2
        victims = next((q for q in self._queues()[: tier + 1] if q), None)
        if self._free_idx:
            idx = self._free_idx.pop()
        elif victims is not None:
            victim, _ = victims.popitem(last=False)
            self._drop(victim)
            idx = victim.index
            self.stats.evicted += 1
        else:
            return None
        s = Snapshot(idx, num_tokens, parent, tail, ref=1, cold=cold, end=end, final=final)
        self._by_key[(parent, tail)] = s
        self._by_parent.setdefault(parent, []).append(s)
        return s

    def commit(self, s: Snapshot) -> None:
        """The step that saved `s` has run: lookups may use it."""
        s.ready = True
        self.stats.saved += 1
        self.release(s)

    def discard(self, s: Snapshot) -> None:
        """The step that was to save `s` did not run: unpin it and give its entry back."""
        self.release(s)
        if not s.ready and s.ref == 0 and self._by_key.get((s.parent, s.tail)) is s:
            self._drop(s)
            self._free_idx.append(s.index)

    def _drop(self, s: Snapshot) -> None:
        del self._by_key[(s.parent, s.tail)]
        sibs = self._by_parent[s.parent]
        sibs.remove(s)
        if not sibs:
            del self._by_parent[s.parent]

    def key_for(self, tokens: list[int], hashes: list[int], p: int) -> tuple[int, tuple[int, ...]]:
        """(parent, tail) of the prefix tokens[:p]."""
        j = p // self.block_size
        return (hashes[j - 1] if j else ROOT_HASH), tuple(tokens[j * self.block_size : p])

    # ---- the digest (cache-aware routing) -------------------------------------------------
    def version(self) -> int:
        """Grows whenever a page or a snapshot is cached or evicted: a sum of counters that only grow
        (pages registered, pages evicted, snapshots saved, snapshots evicted)."""
        b = self.blocks
        return len(b.cached) + 2 * b.num_evicted + self.stats.saved + self.stats.evicted

    def digest(self) -> Digest:
        """Pages in use first, then free cached pages most recently freed first; snapshots being
        read, then the most recently used. Capped at DIGEST_PAGES / DIGEST_SNAPSHOTS."""
        snaps = [s for s in self._by_key.values() if s.ready and s.ref > 0]
        snaps += [*reversed(self._lru), *reversed(self._finals), *reversed(self._cold)]
        snaps = snaps[:DIGEST_SNAPSHOTS]
        b = self.blocks
        pages = b.recent_pages(DIGEST_PAGES)
        return Digest(
            version=self.version(),
            block_size=self.block_size,
            interval=self.interval,
            pages=tuple(page_name(b.hash_of[i], b.after.get(i, -1) if self.mtp else None) for i in pages),
            snapshot_keys=tuple(short(prefix_key(s.parent, s.tail)) for s in snaps),
            snapshot_tokens=tuple(s.num_tokens for s in snaps),
            mtp=self.mtp,
        )

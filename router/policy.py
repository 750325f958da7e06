"""Routing policies by name (`POLICIES`): which decode node reserves a request and which prefill
node computes it. `cache-aware` prices each node in prompt tokens of work after its usable cached
prefix (a prompt the node would send to the prefill pool: its pages save their transfer only)
plus its load; `least-loaded` and `round-robin` (docs/routing.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, Protocol

from router.prefix import PrefixQuery

if TYPE_CHECKING:  # annotations only: building the CLI's parser must not import grpc
    from router.registry import NodeEntry

# pooled(d, uncached): would decode node d send a prompt with `uncached` tokens left to compute
# to the prefill pool (router/prefill.py use_pool)? Without it, d computes every prompt itself.
Pooled = Callable[["NodeEntry", int], bool]
# what a pooled prompt's token already on the decode node saves, in prompt tokens of work: its KV's
# transfer, not its compute (the pool computes the prompt either way)
POOLED_PAGE_SAVING = 0.1
# what each prompt token a decode node must compute again, because another node holds it cached,
# costs beyond its own work: whatever queues behind it there waits for it too, and the
# conversation's later turns follow it (their cache is there now). A burst of follow-up turns
# sees momentary queues that, priced at 0, moved 2-5 of 16 conversations a turn off their caches
# (docs/routing.md)
MOVE_PENALTY = 3.0


class RoutingPolicy(Protocol):
    uses_prefix: bool  # wants a PrefixQuery (the prompt's page hashes) with each choice

    def choose_decode(
        self, nodes: list[NodeEntry], prompt_len: int, q: PrefixQuery | None = None, pooled: Pooled | None = None
    ) -> NodeEntry | None: ...

    def choose_prefill(
        self, nodes: list[NodeEntry], prompt_len: int, q: PrefixQuery | None = None
    ) -> NodeEntry | None: ...


def fits_decode(e: NodeEntry, prompt_len: int) -> bool:
    """Room for prompt + 1 tokens of KV and one GDN state slot (what a reservation takes)."""
    return e.est_free_slots() > 0 and e.est_free_blocks() >= e.blocks_for(prompt_len + 1)


class LeastLoaded:
    """Decode: most free pages and slots (the scarcer of the two, as a fraction), then the
    smallest running batch. Prefill: fewest queued prefill tokens."""

    name = "least-loaded"
    uses_prefix = False

    @staticmethod
    def decode_key(e: NodeEntry):
        c = e.info.capacity
        free = min(e.est_free_slots() / max(1, c.total_slots), e.est_free_blocks() / max(1, c.total_blocks))
        return (-round(free, 3), e.est_running(), e.node_id)

    def choose_decode(self, nodes, prompt_len, q=None, pooled=None):
        ok = [e for e in nodes if fits_decode(e, prompt_len)]
        return min(ok, key=self.decode_key) if ok else None

    def choose_prefill(self, nodes, prompt_len, q=None):
        if not nodes:
            return None
        return min(nodes, key=lambda e: (e.queued_prefill_tokens(), e.node_id))


def decode_hit(e: NodeEntry, q: PrefixQuery, pooled: Pooled | None) -> tuple[int, bool]:
    """(usable cached tokens, prefill pool or not) for the prompt on decode node e: the pool
    decision weighs what e would still compute (the prompt less e's usable snapshot prefix); a
    pooled prompt uses e's leading pages only (the transfer skips them)."""
    hit, pool, _ = _decode_hits(e, q, pooled)
    return hit, pool


def _decode_hits(e: NodeEntry, q: PrefixQuery, pooled: Pooled | None) -> tuple[int, bool, int]:
    """decode_hit's pair, then what e could compute the prompt from itself (its snapshot prefix)."""
    local = e.cache.usable(q, compute=True)
    if pooled is not None and pooled(e, q.prompt_len - local):
        return e.cache.usable(q, compute=False), True, local
    return local, False, local


class CacheAware(LeastLoaded):
    """The cheapest node in prompt tokens of work (the module docstring); least-loaded when no
    node holds any of the prompt."""

    name = "cache-aware"
    uses_prefix = True

    def __init__(self, load_weight: float = 0.1):
        self.load_weight = load_weight

    def choose_decode(self, nodes, prompt_len, q=None, pooled=None):
        ok = [e for e in nodes if fits_decode(e, prompt_len)]
        hits = {e.node_id: _decode_hits(e, q, pooled) for e in ok} if q is not None else {}
        if not any(hit for hit, _, _ in hits.values()):
            return super().choose_decode(ok, prompt_len)
        # the most of the prompt a decode node computing it itself holds
        best = max((hit for hit, pool, _ in hits.values() if not pool), default=0)

        def cost(e: NodeEntry):
            c = e.info.capacity
            held = max(0, c.total_blocks - e.est_free_blocks()) * c.block_size  # KV tokens of running requests
            hit, pool, local = hits[e.node_id]
            # a prompt e would send to the prefill pool is computed there whichever decode node
            # holds its pages: e's pages save only their transfer (else a burst of new
            # conversations sharing a system prompt all lands on the node that took the first)
            saved = hit * POOLED_PAGE_SAVING if pool else hit
            # placed here, what the best node holds beyond what this one could compute from is
            # computed again (here, or by the prefill pool for a pooled prompt) and the
            # conversation's next turns follow it: MOVE_PENALTY more, where this node holds a start
            # of it (a shared system prompt: the difference is a conversation's own history); a
            # node holding none of it is priced as before, so new conversations still spread
            again = MOVE_PENALTY * max(0, best - local) if local else 0
            work = prompt_len - saved + again + e.queued_prefill_tokens() + self.load_weight * held
            return (work, self.decode_key(e))

        return min(ok, key=cost)

    def choose_prefill(self, nodes, prompt_len, q=None):
        hits = {e.node_id: e.cache.usable(q, compute=True) for e in nodes} if q is not None else {}
        if not any(hits.values()):
            return super().choose_prefill(nodes, prompt_len)
        return min(nodes, key=lambda e: (prompt_len - hits[e.node_id] + e.queued_prefill_tokens(), e.node_id))


class RoundRobin:
    """Every fitting node in turn (for tests and comparisons)."""

    name = "round-robin"
    uses_prefix = False

    def __init__(self):
        self._n = 0

    def _pick(self, nodes):
        if not nodes:
            return None
        nodes = sorted(nodes, key=lambda e: e.node_id)
        self._n += 1
        return nodes[self._n % len(nodes)]

    def choose_decode(self, nodes, prompt_len, q=None, pooled=None):
        return self._pick([e for e in nodes if fits_decode(e, prompt_len)])

    def choose_prefill(self, nodes, prompt_len, q=None):
        return self._pick(nodes)


POLICIES = {p.name: p for p in (CacheAware, LeastLoaded, RoundRobin)}
PolicyName = Literal["cache-aware", "least-loaded", "round-robin"]  # the keys of POLICIES


def make_policy(name: str, load_weight: float = 0.1) -> RoutingPolicy:
    """load_weight: cache-aware's price of one KV token held on a decode node, in prompt tokens."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    return CacheAware(load_weight) if name == CacheAware.name else POLICIES[name]()

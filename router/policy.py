"""Routing policies: which decode node reserves a request, which prefill node computes it.

A policy sees the live nodes of one kind (router/registry.py `NodeEntry`, with the router's
own in-flight discount) and returns one that can take the request now, or None (the router then
waits, bounded, for capacity). Policies are chosen by name from `POLICIES`.
"""

from __future__ import annotations

from typing import Literal, Protocol

from router.registry import NodeEntry


class RoutingPolicy(Protocol):
    def choose_decode(self, nodes: list[NodeEntry], prompt_len: int) -> NodeEntry | None: ...

    def choose_prefill(self, nodes: list[NodeEntry], prompt_len: int) -> NodeEntry | None: ...


def fits_decode(e: NodeEntry, prompt_len: int) -> bool:
    """Room for prompt + 1 tokens of KV and one GDN state slot (what a reservation takes)."""
    return e.est_free_slots() > 0 and e.est_free_blocks() >= e.blocks_for(prompt_len + 1)


class LeastLoaded:
    """Decode: most free pages and slots (the scarcer of the two, as a fraction), then the
    smallest running batch. Prefill: fewest queued prefill tokens."""

    name = "least-loaded"

    def choose_decode(self, nodes, prompt_len):
        def key(e: NodeEntry):
            c = e.info.capacity
            free = min(e.est_free_slots() / max(1, c.total_slots), e.est_free_blocks() / max(1, c.total_blocks))
            return (-round(free, 3), max(c.running, e.inflight), e.node_id)

        ok = [e for e in nodes if fits_decode(e, prompt_len)]
        return min(ok, key=key) if ok else None

    def choose_prefill(self, nodes, prompt_len):
        if not nodes:
            return None
        return min(nodes, key=lambda e: (e.info.capacity.queued_prefill_tokens + e.inflight_prefill_tokens, e.node_id))


class RoundRobin:
    """Every fitting node in turn (for tests and comparisons)."""

    name = "round-robin"

    def __init__(self):
        self._n = 0

    def _pick(self, nodes):
        if not nodes:
            return None
        nodes = sorted(nodes, key=lambda e: e.node_id)
        self._n += 1
        return nodes[self._n % len(nodes)]

    def choose_decode(self, nodes, prompt_len):
        return self._pick([e for e in nodes if fits_decode(e, prompt_len)])

    def choose_prefill(self, nodes, prompt_len):
        return self._pick(nodes)


POLICIES = {p.name: p for p in (LeastLoaded, RoundRobin)}
PolicyName = Literal["least-loaded", "round-robin"]  # the keys of POLICIES


def make_policy(name: str) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    return POLICIES[name]()

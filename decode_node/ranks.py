"""Rank-side helpers for the decode node's receiver endpoints (run through executor.call_all,
so on every tensor-parallel rank, in its own process when TP > 1). A reservation is keyed by
(request id, incarnation): one incarnation for all ranks of one Reserve."""

from __future__ import annotations

from transfer import rank as xr


def adopt(worker, backend: str, rid: str, prompt_len: int, blocks: list[int], slot: int, lease_s: float, inc: int):
    return xr.adopt(worker, backend, rid, prompt_len, blocks, slot, lease_s=lease_s, incarnation=inc)


def poll(worker, backend: str, keys: list[tuple[str, int]]) -> list[tuple[str, str | None, bool, int, bool]]:
    """Drive the endpoint once; (state, failure, freed, lease renewals, lease expired) per
    reservation ("gone" once forgotten)."""
    ep = xr.endpoint(worker, backend)
    ep.poll()
    out = []
    for rid, inc in keys:
        r = ep.requests.get((rid, inc))
        if r is None:  # ended (taken, or failed and freed): say why it failed, if it did
            out.append(("gone", ep.recent.get((rid, inc)), True, 0, (rid, inc) in ep.recent_expired))
        else:
            out.append((r.state.value, r.error, r.freed, r.renewals, r.expired))
    return out


def abort(worker, backend: str, rid: str, inc: int, reason: str) -> None:
    """Fail (or, when done, release) a reservation; its memory is freed once no write can land."""
    ep = xr.endpoint(worker, backend)
    r = ep.requests.get((rid, inc))
    if r is not None:
        r.abort(reason)


def take(worker, backend: str, rid: str, inc: int) -> None:
    xr.endpoint(worker, backend).requests[(rid, inc)].take()


def drop_node(worker, backend: str, node: str, reason: str = "declared dead by the router") -> list[str]:
    """Remove every agent of a source node: its reservations fail and free once safe."""
    ep = xr.endpoint(worker, backend)
    gone = [a for a, p in list(ep.peers.items()) if p.info.node == node]
    for a in gone:
        ep.remove_peer(a, reason)
    return gone


def blobs(worker, backend: str) -> bytes:
    return xr.endpoint(worker, backend).metadata()

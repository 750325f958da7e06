"""Rank-side helpers for the prefill node's sender endpoints (run through executor.call_all).
Each rank keeps its SendRequest objects until the node forgets them, so a failure that turned
quiet between two polls is still reported as a failure."""

from __future__ import annotations

from transfer import rank as xr

_KEY = "prefill.sends"


def send(worker, backend: str, rid: str, target, blocks: list[int], slot: int, num_tokens: int) -> None:
    req = xr.endpoint(worker, backend).send(rid, target, blocks, slot, num_tokens, owned=False)
    worker.ext.setdefault(_KEY, {})[rid] = req


def open_send(worker, backend: str, rid: str, target, blocks: list[int], slot: int, num_tokens: int) -> None:
    """Begin to the destination ranks now; the writes follow with `post` once the state exists."""
    req = xr.endpoint(worker, backend).open(rid, target, blocks, slot, num_tokens, owned=False)
    worker.ext.setdefault(_KEY, {})[rid] = req


def post(worker, backend: str, rid: str) -> None:
    """Write everything and Done: at once when the grants are in (polled first), else when they come."""
    xr.endpoint(worker, backend).poll()
    worker.ext[_KEY][rid].post()


def renew(worker, backend: str, targets: list) -> int:
    """Restart the lease of each target's reservation on the destination ranks this rank writes."""
    ep = xr.endpoint(worker, backend)
    return sum(ep.renew(t) for t in targets)


def poll(worker, backend: str, rids: list[str]) -> list[tuple[str, str | None, bool, int]]:
    """Drive the endpoint once; (state, failure, quiet, bytes) per request ("gone": never opened here)."""
    ep = xr.endpoint(worker, backend)
    ep.poll()
    store = worker.ext.get(_KEY, {})
    out = []
    for rid in rids:
        r = store.get(rid)
        out.append(("gone", None, True, 0) if r is None else (r.state.value, r.error, r.quiet, r.nbytes))
    return out


def abort(worker, backend: str, rid: str, reason: str) -> None:
    r = worker.ext.get(_KEY, {}).get(rid)
    if r is not None:
        r.abort(reason)


def forget(worker, backend: str, rid: str) -> None:
    worker.ext.get(_KEY, {}).pop(rid, None)


def blobs(worker, backend: str) -> bytes:
    return xr.endpoint(worker, backend).metadata()

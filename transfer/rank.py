"""Transfer endpoints inside an engine's tensor-parallel workers.

A node drives its ranks through the engine executor: `engine.executor.call_all(fn, ...)` runs
`fn(worker, ...)` on every rank, where each rank's `Sender` / `Receiver` lives next to its
pools in `worker.ext`. The engine's scheduler owns block and slot allocation; the receiver
adopts the engine's reservation, and memory of a failed reservation is reported back through
`freed` once no write can still land, so the node can return it to the scheduler.

    metas = D.executor.call_all(open_endpoint, "receiver", "D0", cfg)      # one blob per rank
    P.executor.call_all(add_peers, "nixl", metas) ...                        # and the reverse
    blocks, slot = D.reserve(prompt, params, rid)                            # engine allocates
    ranks = D.executor.call_all(adopt, "nixl", rid, len(prompt), blocks, slot)
    target = make_target(ranks, rid, len(prompt), ...)                      # to the prefill node
    P.executor.call_all(send, "nixl", rid, target, *P.held(rid), len(prompt))
    poll both until every rank reports DONE; D.activate(rid, first_token); P.release(rid)
"""

from __future__ import annotations

from collections import deque

from transfer.backend import TransferState
from transfer.config import TransferConfig
from transfer.messages import Target, TargetRank
from transfer.receiver import Receiver
from transfer.sender import Sender


def _key(backend: str) -> str:
    return f"transfer.{backend}"


def endpoint(worker, backend: str):
    ep = worker.ext.get(_key(backend))
    if ep is None:
        raise RuntimeError(f"rank {worker.rank} has no {backend} transfer endpoint; call open_endpoint first")
    return ep


def open_endpoint(worker, role: str, node: str, config: TransferConfig | None = None) -> bytes:
    """Create this rank's sender or receiver over its pools; returns its handshake blob."""
    config = config or TransferConfig()
    cls = {"sender": Sender, "receiver": Receiver}.get(role)
    if cls is None:
        raise ValueError(f"unknown transfer role {role!r}; known: sender, receiver")
    ep = cls(worker.cfg, worker.rank, worker.pools, node=node, config=config)
    worker.ext[_key(config.backend)] = ep
    worker.ext.setdefault("transfer.freed", deque(maxlen=4096))  # recent failed reservations, freed
    return ep.metadata()


def add_peers(worker, backend: str, blobs: list[bytes]) -> list[str]:
    """Handshake with every rank of a peer node (raises HandshakeError naming the field)."""
    ep = endpoint(worker, backend)
    return [ep.add_peer(b) for b in blobs]


def remove_peer(worker, backend: str, agent: str, reason: str = "declared dead") -> None:
    endpoint(worker, backend).remove_peer(agent, reason)


def adopt(
    worker,
    backend: str,
    request_id: str,
    prompt_len: int,
    blocks: list[int],
    slot: int,
    lease_s: float | None = None,
    incarnation: int | None = None,
) -> TargetRank:
    """Receiver: take the engine's reservation under a lease; returns this rank's target."""
    freed = worker.ext["transfer.freed"]
    req = endpoint(worker, backend).adopt(
        request_id,
        prompt_len,
        blocks,
        slot,
        lease_s=lease_s,
        incarnation=incarnation,
        free=lambda b, s: freed.append(request_id),
    )
    return req.target


def make_target(ranks: list[TargetRank], node: str, request_id: str, prompt_len: int, tp: int, digest: str) -> Target:
    return Target(request_id, node, tp, digest, prompt_len, sorted(ranks, key=lambda t: t.rank))


def digest(worker, backend: str) -> str:
    return endpoint(worker, backend).digest


def send(worker, backend: str, request_id: str, target: Target, blocks: list[int], slot: int, num_tokens: int) -> None:
    """Sender: write this rank's pieces of the request's state into the target (memory stays the
    engine's: release the HELD request once every rank reports quiet)."""
    endpoint(worker, backend).send(request_id, target, blocks, slot, num_tokens, owned=False)


def poll(worker, backend: str, request_id: str) -> tuple[str, str | None, bool]:
    """(state, failure, quiet) of this rank's side of the request; drives the endpoint."""
    ep = endpoint(worker, backend)
    ep.poll()
    if isinstance(ep, Sender):
        req = ep.requests.get(request_id)
        if req is None:  # forgotten once quiet and terminal
            return TransferState.DONE.value, None, True
        return req.state.value, req.failure(), req.quiet
    req = next((r for (rid, _), r in ep.requests.items() if rid == request_id), None)
    if req is None:
        freed = request_id in worker.ext["transfer.freed"]
        return (TransferState.FAILED.value if freed else "unknown"), None, True
    return req.state.value, req.failure(), req.freed


def take(worker, backend: str, request_id: str) -> None:
    """Receiver: a DONE request's memory goes back to the engine's request (now decoding)."""
    ep = endpoint(worker, backend)
    req = next(r for (rid, _), r in ep.requests.items() if rid == request_id)
    req.take()


def abort(worker, backend: str, request_id: str, reason: str = "aborted") -> None:
    ep = endpoint(worker, backend)
    if isinstance(ep, Sender):
        req = ep.requests.get(request_id)
    else:
        req = next((r for (rid, _), r in ep.requests.items() if rid == request_id), None)
    if req is not None:
        req.abort(reason)


def close(worker, backend: str) -> None:
    ep = worker.ext.pop(_key(backend), None)
    if ep is not None:
        ep.close()

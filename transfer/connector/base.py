"""What both sides of the connector share: one transfer endpoint per engine rank, opened at
construction through the engine's executor (transfer/rank.py runs on each rank), its handshake
blobs and model digest, the peers it knows, and closing it.

Called on the thread that owns the engine (a node's engine loop), like the Connector methods;
`close` once that loop has stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Concatenate, Literal, ParamSpec, TypeVar

from engine.executor import Executor
from transfer import rank as xr
from transfer.config import TransferConfig

log = logging.getLogger("pdserve.transfer")

if TYPE_CHECKING:
    from engine.request import Request
    from engine.worker import Worker

_T = TypeVar("_T")
_P = ParamSpec("_P")


class RankEndpoints:
    def __init__(
        self, executor: Executor, role: Literal["sender", "receiver"], node: str, config: TransferConfig
    ) -> None:
        self.executor = executor
        self.node = node
        self.config = config
        self.backend: str = config.backend
        self.block_size: int = executor.capacity.block_size
        self.blobs: list[bytes] = self.call_all(xr.open_endpoint, role, node, config)  # one per rank
        self.digest: str = self.call_all(xr.digest, self.backend)[0]

    def call_all(self, fn: Callable[Concatenate[Worker, _P], _T], *args: _P.args, **kwargs: _P.kwargs) -> list[_T]:
        """fn(worker, *args) on every rank; results by rank."""
        return self.executor.call_all(fn, *args, **kwargs)

    def add_peers(self, blobs: list[bytes]) -> list[str]:
        """Handshake with every rank of a peer node (raises HandshakeError naming the field)."""
        return [a for per_rank in self.call_all(xr.add_peers, self.backend, blobs) for a in per_rank]

    def drop_node(self, node: str) -> list[str]:
        """Remove every transfer agent of a peer node (declared dead): its transfers here fail."""
        return sorted({a for per_rank in self.call_all(xr.drop_node, self.backend, node) for a in per_rank})

    def close(self) -> None:
        try:
            self.call_all(xr.close, self.backend)
        except Exception as e:  # ranks already gone (a signal to the whole process group)
            log.debug("closing the transfer endpoints: %s", e)


def state_slot(request: Request) -> int:
    """The GDN state slot a request holds (every request that has memory has one)."""
    if request.slot is None:
        raise RuntimeError(f"request {request.request_id} holds no state slot")
    return request.slot

"""The data-plane interface every backend implements, the state enum, and the registry.

A `Transport` belongs to one endpoint (one rank, one role). It registers that rank's pool
tensors once at start-up, connects to peers from their published blob, moves the bytes of a
channel plan (source rank -> destination rank), and carries the small control messages
(`transfer.messages`) as notifications. The protocol above it (`Sender`, `Receiver`) is the same
for every backend; a backend is chosen by name from `TRANSPORTS`.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar, NamedTuple

import torch

from transfer.plan import RegionPair


class TransferState(enum.Enum):
    PENDING = "pending"  # reserved / opened; no byte moved yet
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED)


class WriteJob(NamedTuple):
    """One post of one channel: the selected region pairs (with their index in the channel's
    full pair list, which numbers UCXX tags) and the request's ids."""

    pairs: Sequence[tuple[int, RegionPair]]
    src_blocks: Sequence[int]
    dst_blocks: Sequence[int]
    src_slot: int
    dst_slot: int
    notif: bytes | None  # delivered to the destination once the job's bytes have landed
    tag_base: int = 0
    stage_slot: int | None = None  # the staging slot a cast pair reads (transfer/staging.py)


class Transport(ABC):
    """Data plane of one endpoint. Not thread-safe: the owner calls it from one thread."""

    name: ClassVar[str]
    partial_pages: ClassVar[bool] = False  # can write some of a region's pages now, the rest later

    def __init__(self, agent: str, regions: dict[tuple[int, str], torch.Tensor]) -> None:
        self.agent = agent
        self.regions = regions  # (layer, kind) -> pool tensor, registered once

    def add_regions(self, regions: dict[tuple[int, str], torch.Tensor]) -> None:
        """Sender side: register more source memory (a cast's staging regions) after start-up."""
        self.regions.update(regions)

    @abstractmethod
    def metadata(self) -> bytes:
        """What a peer needs to reach this endpoint (NIXL agent metadata, UCX worker address)."""

    @abstractmethod
    def add_peer(self, agent: str, blob: bytes) -> None: ...

    @abstractmethod
    def remove_peer(self, agent: str) -> None:
        """Forget a peer (declared dead or replaced): nothing of it can land here afterwards."""

    def prepare(self, agent: str, pairs: Sequence[RegionPair]) -> None:  # noqa: B027 (optional hook, no-op by default)
        """Sender side, once per peer: prepare descriptors for every page of every region pair."""

    @abstractmethod
    def write(self, agent: str, job: WriteJob) -> object:
        """Start writing `job` into the peer's pools; returns a handle for `state` / `release`."""

    @abstractmethod
    def state(self, handle: object) -> TransferState:
        """TRANSFERRING, DONE (all bytes landed, notification sent) or FAILED."""

    @abstractmethod
    def release(self, handle: object, force: bool = False) -> bool:
        """Free a finished handle. `force` also cancels one in flight (peer gone); True if freed."""

    def new_tag_base(self) -> int:
        """Receiver side: a fresh, never reused base for the data tags of one channel (tagged backends)."""
        return 0

    def expect(
        self,
        agent: str,
        pairs: Sequence[RegionPair],
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        src_slot: int,
        dst_slot: int,
        tag_base: int,
    ) -> object | None:
        """Receiver side: make room for a channel's bytes before granting it (two-sided backends)."""
        return None

    def expect_state(self, handle: object | None) -> TransferState:
        return TransferState.DONE

    def drain(
        self,
        agent: str,
        pairs: Sequence[tuple[int, RegionPair]],
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        src_slot: int,
        dst_slot: int,
        tag_base: int,
    ) -> object | None:
        """Sender side, on abort: settle what the receiver still expects for unsent regions."""
        return None

    @abstractmethod
    def send_control(self, agent: str, payload: bytes) -> None: ...

    @abstractmethod
    def poll_control(self) -> list[bytes]:
        """Control payloads received since the last call, in arrival order."""

    def progress(self) -> None:  # noqa: B027 (optional hook, no-op by default)
        """Drive the backend (two-sided backends progress their worker here)."""

    @abstractmethod
    def close(self) -> None: ...


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor sharing its memory."""
    return t.reshape(-1).view(torch.uint8)


def host_bytes(t: torch.Tensor) -> memoryview:
    """A byte range's memory (e.g. for a checksum): shared for CPU memory, copied for device memory."""
    return (t if t.device.type == "cpu" else t.cpu()).numpy().data


def _nixl() -> type[Transport]:
    from transfer.nixl_backend import NixlTransport  # noqa: PLC0415 (import only the backend in use)

    return NixlTransport


def _ucxx() -> type[Transport]:
    from transfer.ucxx_backend import UcxxTransport  # noqa: PLC0415

    return UcxxTransport


TRANSPORTS: dict[str, Callable[[], type[Transport]]] = {"nixl": _nixl, "ucxx": _ucxx}


def get_transport(name: str) -> type[Transport]:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transfer backend {name!r}; known backends: {', '.join(sorted(TRANSPORTS))}")
    return TRANSPORTS[name]()

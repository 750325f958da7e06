"""Transfer configuration: one frozen dataclass, checked at construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class TransferConfig:
    backend: Literal["nixl", "ucxx"] = "nixl"  # data plane; see transfer.backend.TRANSPORTS
    # the address whose network interface UCX uses (transfer/netif.py); a wildcard ("0.0.0.0"):
    # every interface; None: leave UCX_NET_DEVICES as the environment has it
    bind_host: str | None = "127.0.0.1"
    checksum: bool = False  # crc32 over a channel's bytes, sent with Done, checked by the destination
    lease_s: float = 60.0  # receiver: a reservation not completed by then is released
    grant_timeout_s: float = 30.0  # sender: a destination that neither grants nor refuses by then fails the request
    quiesce_timeout_s: float = 30.0  # sender: a write still in flight this long after an abort is cancelled
    # NIXL's own progress thread busy-polls a core even when idle; endpoints progress NIXL from
    # poll() instead. Turn it on where cores are plentiful and poll() runs rarely.
    nixl_progress_thread: bool = False
    # UCX endpoints with peer-failure handling: a dead peer fails its requests instead of hanging
    # them, but UCX then excludes its shared-memory transports (about 1 GB/s instead of about 9 on
    # loopback). Off only where the router's remove_peer is trusted to settle dead peers.
    ucxx_error_handling: bool = True
    # GPU pools on different machines without RDMA on both: refused at handshake unless set
    # (every byte would be staged through host memory over TCP; transfer/links.py)
    allow_tcp_staging: bool = False
    # sender: slots of bfloat16 staging per GDN layer for a float32 state feeding a bfloat16 node
    # (transfer/staging.py); a request holds one from its state's cast until its writes are over,
    # and a request finding none free waits for one
    staging_slots: int = 4

    def __post_init__(self) -> None:
        from transfer.backend import TRANSPORTS  # noqa: PLC0415

        if self.backend not in TRANSPORTS:
            raise ValueError(
                f"unknown transfer backend {self.backend!r}; known backends: {', '.join(sorted(TRANSPORTS))}"
            )
        if self.staging_slots < 1:
            raise ValueError(f"staging_slots must be at least 1 (got {self.staging_slots})")
        for name in ("lease_s", "grant_timeout_s", "quiesce_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive (got {getattr(self, name)})")

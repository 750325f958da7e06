"""NIXL data plane: one-sided WRITEs from a source rank's pools into a destination rank's. Pools are
registered once (DRAM or VRAM), descriptor lists prepared once per peer, and each request posts
indices into them with `make_prepped_xfer` (docs/transfer.md, "Module notes")."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol

import numpy as np
import numpy.typing as npt
import torch

from transfer.backend import TransferState, Transport, WriteJob
from transfer.errors import PeerUnreachable
from transfer.nixl_api import nixl_api
from transfer.plan import RegionPair, block_order

log = logging.getLogger(__name__)

Rows = npt.NDArray[np.uint64]  # descriptor / registration rows (addr, len, device)
Indices = npt.NDArray[np.int32]  # indices into a prepared descriptor list
Bases = dict[tuple[int, int], int]  # (pair index, template index) -> first descriptor index

# How long close() waits for this agent's WRITEs still in flight. Over TCP, UCX emulates a WRITE
# with messages the destination answers; a destination that reads one after the writer's socket
# closed cannot answer, and UCX aborts that process (docs/transfer.md, "A writer that exits").
CLOSE_DRAIN_S = 2.0

# NIXL's errors when add_remote_agent cannot connect to the peer (by name: the classes live in the
# build's own module, nixl_cu12 or nixl_cu13)
_UNREACHABLE = ("nixlBackendError", "nixlRemoteDisconnectError")


class _Handle(Protocol):
    """A NIXL prepared descriptor list or transfer handle."""

    def release(self) -> None: ...


class _Agent(Protocol):
    """The part of `nixl._api.nixl_agent` this backend calls (nixl ships no type information)."""

    def get_agent_metadata(self) -> bytes: ...
    def add_remote_agent(self, metadata: bytes, /) -> str | bytes: ...
    def remove_remote_agent(self, agent: str, /) -> None: ...
    def register_memory(self, rows: Rows, mem_type: str, /) -> object: ...
    def deregister_memory(self, registration: object, /) -> None: ...
    def prep_xfer_dlist(self, agent: str, rows: Rows, mem_type: str, /) -> _Handle: ...
    def make_prepped_xfer(
        self, op: str, local: _Handle, local_indices: Indices, remote: _Handle, remote_indices: Indices, notif: bytes, /
    ) -> _Handle: ...
    def transfer(self, handle: _Handle, /) -> str: ...
    def check_xfer_state(self, handle: _Handle, /) -> str: ...
    def send_notif(self, agent: str, payload: bytes, /) -> None: ...
    def get_new_notifs(self) -> dict[str, list[bytes]]: ...


class _Xfer(NamedTuple):
    """What `write` returns for a posted WRITE: the peer and NIXL's transfer handle."""

    agent: str
    handle: _Handle


def _xfer(handle: object) -> _Xfer:
    if not isinstance(handle, _Xfer):
        raise TypeError(f"not a NIXL transfer handle: {handle!r}")
    return handle


class _Prepped:
    """Prepared descriptor lists for one peer and the index base of each (pair, template)."""

    def __init__(self, local: _Handle, remote: _Handle, lbase: Bases, rbase: Bases, num_descs: int) -> None:
        self.local, self.remote = local, remote
        self.lbase, self.rbase = lbase, rbase
        self.num_descs = num_descs


def _rows(pairs: Sequence[RegionPair], side: str) -> tuple[Rows, Bases]:
    """(N, 3) descriptor rows (addr, len, dev) and the first row of each (pair index, template index).

    Paged regions: (template, page) order, so consecutive block ids are adjacent indices.
    Slot regions: (slot, template) order, so a slot's templates are adjacent indices.
    """
    chunks: list[Rows] = []
    base: Bases = {}
    n = 0
    for i, p in enumerate(pairs):
        d = p.src if side == "src" else p.dst
        offs = np.array([t.src_off if side == "src" else t.dst_off for t in p.templates], dtype=np.uint64)
        lens = np.array([t.length for t in p.templates], dtype=np.uint64)
        pages = np.arange(d.num_pages, dtype=np.uint64) * np.uint64(d.page_stride) + np.uint64(d.base_addr)
        if p.paged:
            addr = (offs[:, None] + pages[None, :]).reshape(-1)
            ln = np.repeat(lens, d.num_pages)
            for j in range(len(p.templates)):
                base[(i, j)] = n + j * d.num_pages
        else:
            addr = (pages[:, None] + offs[None, :]).reshape(-1)
            ln = np.tile(lens, d.num_pages)
            base[(i, 0)] = n
        rows = np.stack([addr, ln, np.full(len(addr), d.device_id, dtype=np.uint64)], axis=1)
        chunks.append(rows)
        n += len(rows)
    return (np.concatenate(chunks) if chunks else np.zeros((0, 3), dtype=np.uint64)), base


def job_indices(
    pairs: Sequence[tuple[int, RegionPair]], lbase: Bases, rbase: Bases, job: WriteJob
) -> tuple[Indices, Indices]:
    """Local and remote descriptor indices of a job, in the plan's canonical order."""
    sb, db = block_order(job.src_blocks, job.dst_blocks)
    li: list[npt.NDArray[np.int64]] = []
    ri: list[npt.NDArray[np.int64]] = []
    for i, p in pairs:
        nt = len(p.templates)
        if p.paged:
            for j in range(nt):
                li.append(lbase[(i, j)] + sb)
                ri.append(rbase[(i, j)] + db)
        else:
            slot = job.stage_slot if p.cast and job.stage_slot is not None else job.src_slot
            li.append(lbase[(i, 0)] + slot * nt + np.arange(nt))
            ri.append(rbase[(i, 0)] + job.dst_slot * nt + np.arange(nt))
    if not li:
        return np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32)
    return np.concatenate(li).astype(np.int32), np.concatenate(ri).astype(np.int32)


def registration(tensors: Iterable[torch.Tensor]) -> list[tuple[str, Rows]]:
    """Pool tensors as NIXL registration rows (addr, len, device), one list per memory type and
    device: ("DRAM", rows) for CPU tensors, ("VRAM", rows) for each CUDA device's tensors."""
    groups: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"NIXL registers whole contiguous pools (got {tuple(t.shape)} strides {t.stride()})")
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"NIXL registers CPU or CUDA memory (got a pool on {t.device})")
        key = ("DRAM", 0) if t.device.type == "cpu" else ("VRAM", t.device.index or 0)
        groups.setdefault(key, []).append((t.data_ptr(), t.numel() * t.element_size(), key[1]))
    return [(mem, np.array(rows, dtype=np.uint64)) for (mem, _), rows in groups.items()]


def side_mem_type(pairs: Sequence[RegionPair], side: str) -> str:
    """The one memory type of a side's regions (a prepared descriptor list holds one type)."""
    kinds = {(p.src if side == "src" else p.dst).mem_type for p in pairs}
    if len(kinds) > 1:
        raise ValueError(f"{side} regions mix memory types {sorted(kinds)}; NIXL prepares one type per list")
    return kinds.pop() if kinds else "DRAM"


class NixlTransport(Transport):
    name = "nixl"
    partial_pages = True  # one-sided: any subset of the prepared descriptors, in any number of WRITEs

    def __init__(self, agent: str, regions: dict[tuple[int, str], torch.Tensor], progress_thread: bool = False) -> None:
        super().__init__(agent, regions)
        nixl_agent, nixl_agent_config = nixl_api()

        self.nx: _Agent = nixl_agent(agent, nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"]))
        self.reg = [self.nx.register_memory(rows, mem) for mem, rows in registration(regions.values())]
        self.prepped: dict[str, _Prepped] = {}
        self.handles: dict[str, set[_Handle]] = {}  # peer -> live xfer handles
        self.last_post: dict[str, float] = {}  # indices, make_s, post_s of the latest write (observability)

    def add_regions(self, regions: dict[tuple[int, str], torch.Tensor]) -> None:
        """Local memory only (staging the sender writes from): peers never address it, so the
        metadata published at start-up stays valid."""
        super().add_regions(regions)
        self.reg.extend(self.nx.register_memory(rows, mem) for mem, rows in registration(regions.values()))

    def metadata(self) -> bytes:
        return self.nx.get_agent_metadata()

    def add_peer(self, agent: str, blob: bytes) -> None:
        try:
            name = self.nx.add_remote_agent(blob)  # UCX connects to the peer's worker here
        except Exception as e:
            if type(e).__name__ not in _UNREACHABLE:
                raise
            raise PeerUnreachable(f"{e} (its process is gone, or its data-plane address cannot be reached)") from None
        name = name.decode() if isinstance(name, bytes) else name
        if name != agent:
            self.nx.remove_remote_agent(name)
            raise ValueError(f"NIXL metadata names agent {name!r}, the handshake said {agent!r}")
        self.handles[agent] = set()

    def prepare(self, agent: str, pairs: Sequence[RegionPair]) -> None:
        lrows, lbase = _rows(pairs, "src")
        rrows, rbase = _rows(pairs, "dst")
        local = self.nx.prep_xfer_dlist("NIXL_INIT_AGENT", lrows, side_mem_type(pairs, "src"))
        remote = self.nx.prep_xfer_dlist(agent, rrows, side_mem_type(pairs, "dst"))
        self.prepped[agent] = _Prepped(local, remote, lbase, rbase, len(lrows))

    def write(self, agent: str, job: WriteJob) -> _Xfer | None:
        pp = self.prepped[agent]
        li, ri = job_indices(job.pairs, pp.lbase, pp.rbase, job)
        if len(li) == 0:
            if job.notif is not None:
                self.nx.send_notif(agent, job.notif)
            return None
        t0 = time.perf_counter()
        h = self.nx.make_prepped_xfer("WRITE", pp.local, li, pp.remote, ri, job.notif or b"")
        t1 = time.perf_counter()
        status = self.nx.transfer(h)
        self.last_post = {"indices": len(li), "make_s": t1 - t0, "post_s": time.perf_counter() - t1}
        if status == "ERR":
            h.release()
            raise RuntimeError(f"NIXL refused to post a WRITE of {len(li)} descriptors to {agent}")
        self.handles[agent].add(h)
        return _Xfer(agent, h)

    def state(self, handle: object) -> TransferState:
        if handle is None:
            return TransferState.DONE
        s = self.nx.check_xfer_state(_xfer(handle).handle)
        return {"DONE": TransferState.DONE, "PROC": TransferState.TRANSFERRING}.get(s, TransferState.FAILED)

    def release(self, handle: object, force: bool = False) -> bool:
        if handle is None:
            return True
        agent, h = _xfer(handle)
        if not force and self.state(handle) is TransferState.TRANSFERRING:
            return False
        try:
            h.release()  # cancels a transfer still in flight, or raises if it cannot
        except Exception as e:  # noqa: BLE001 (NIXL raises its own error types)
            log.warning("NIXL could not release a transfer to %s: %s", agent, e)
            return False
        self.handles.get(agent, set()).discard(h)
        return True

    def remove_peer(self, agent: str) -> None:
        for h in list(self.handles.pop(agent, ())):
            try:
                h.release()
            except Exception as e:  # noqa: BLE001
                log.warning("NIXL transfer to removed agent %s not released: %s", agent, e)
        pp = self.prepped.pop(agent, None)
        if pp is not None:
            pp.local.release()
            pp.remote.release()
        try:
            self.nx.remove_remote_agent(agent)
        except Exception as e:  # noqa: BLE001
            log.warning("NIXL remove_remote_agent(%s): %s", agent, e)

    def send_control(self, agent: str, payload: bytes) -> None:
        self.nx.send_notif(agent, payload)

    def poll_control(self) -> list[bytes]:
        out: list[bytes] = []
        for msgs in self.nx.get_new_notifs().values():
            out.extend(msgs)
        return out

    def in_flight(self) -> int:
        """WRITEs posted and not yet finished (checking their state progresses UCX)."""
        return sum(self.nx.check_xfer_state(h) == "PROC" for hs in self.handles.values() for h in hs)

    def close(self) -> None:
        end = time.monotonic() + CLOSE_DRAIN_S
        while (n := self.in_flight()) and time.monotonic() < end:
            time.sleep(0.001)
        if n:
            log.warning("NIXL agent closing with %d WRITEs still in flight after %.0f s", n, CLOSE_DRAIN_S)
        for agent in list(self.handles):
            self.remove_peer(agent)
        for reg in self.reg:
            self.nx.deregister_memory(reg)

"""UCXX data plane: the same channel plans carried as UCX tagged messages, for clusters without
NIXL; receives are posted into pool memory before the grant, with tags that are never reused
(docs/transfer.md, "Module notes")."""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from transfer.backend import TransferState, Transport, WriteJob, byte_view
from transfer.plan import RegionPair, expand_arrays, src_key

log = logging.getLogger(__name__)

Bytes = npt.NDArray[np.uint8]


# The parts of ucxx this backend calls (ucxx ships no type information). Buffers are passed
# wrapped in `ucxx._lib.arr.Array`, tags as `UCXXTag`: both opaque here.
class _Request(Protocol):
    @property
    def completed(self) -> bool: ...
    def check_error(self) -> None: ...


class _Endpoint(Protocol):
    @property
    def alive(self) -> bool: ...
    def close(self) -> None: ...
    def tag_send(self, buf: object, tag: object, /) -> _Request: ...
    def tag_recv(self, buf: object, tag: object, /) -> _Request: ...


class _Probe(Protocol):
    @property
    def matched(self) -> bool: ...
    @property
    def length(self) -> int: ...


class _Address(Protocol):
    def tobytes(self) -> bytes: ...


class _Worker(Protocol):
    @property
    def address(self) -> _Address: ...
    def progress(self) -> None: ...
    def create_endpoint_from_worker_address(self, address: object, error_handling: bool, /) -> _Endpoint: ...
    def tag_probe(self, tag: object, /, *, remove: bool) -> _Probe: ...
    def tag_recv_with_handle(self, buf: object, probe: _Probe, /) -> _Request: ...


CONTROL_TAG = 1 << 63
REGION_SHIFT = 20
CHANNEL_SHIFT = 31


class _Requests:
    """UCX requests of one channel post, the buffers they need alive, and a notification to
    send once all of them completed."""

    def __init__(self, agent: str, reqs: list[_Request], keep: list[Bytes], notif: bytes | None) -> None:
        self.agent, self.reqs, self.keep, self.notif = agent, reqs, keep, notif
        self.error: str | None = None


def _requests(handle: object) -> _Requests:
    if not isinstance(handle, _Requests):
        raise TypeError(f"not a UCXX transfer handle: {handle!r}")
    return handle


class UcxxTransport(Transport):
    name = "ucxx"

    def __init__(self, agent: str, regions: dict[tuple[int, str], torch.Tensor], error_handling: bool = True) -> None:
        super().__init__(agent, regions)
        self.error_handling = error_handling
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        os.environ.setdefault("UCX_RNDV_FRAG_MEM_TYPE", "host")  # CPU pools; ucxx would pick "cuda"
        from ucxx._lib import libucxx as ucx  # noqa: PLC0415
        from ucxx._lib.arr import Array  # noqa: PLC0415

        self.ucx, self.Array = ucx, Array
        self.ctx = ucx.UCXContext(feature_flags=(ucx.Feature.TAG,))
        self.worker: _Worker = ucx.UCXWorker(self.ctx)
        if any(t.device.type != "cpu" for t in regions.values()):
            raise NotImplementedError("the UCXX backend moves CPU pools only in this version")
        self.views: dict[tuple[int, str], Bytes] = {k: byte_view(t).numpy() for k, t in regions.items()}
        self.eps: dict[str, _Endpoint] = {}
        self._sends: list[tuple[_Request, Bytes | None]] = []  # control sends in flight, with their buffers
        self._ctl_recvs: deque[tuple[_Request, Bytes]] = deque()  # (request, buffer) in arrival order
        self._empty = np.zeros(0, dtype=np.uint8)
        self._channels = 0

    def add_regions(self, regions: dict[tuple[int, str], torch.Tensor]) -> None:
        if any(t.device.type != "cpu" for t in regions.values()):
            raise NotImplementedError("the UCXX backend moves CPU pools only in this version")
        super().add_regions(regions)
        self.views.update({k: byte_view(t).numpy() for k, t in regions.items()})

    def metadata(self) -> bytes:
        return self.worker.address.tobytes()

    def add_peer(self, agent: str, blob: bytes) -> None:
        addr = self.ucx.UCXAddress.create_from_buffer(blob)
        self.eps[agent] = self.worker.create_endpoint_from_worker_address(addr, self.error_handling)

    def remove_peer(self, agent: str) -> None:
        ep = self.eps.pop(agent, None)
        if ep is None:
            return
        self.worker.progress()  # lets UCX notice a dead peer: its endpoint error cancels the receives
        if ep.alive:
            ep.close()  # a live peer: closing cancels receives still posted on it
        # (closing an endpoint that already failed crashes ucxx 0.52, so a dead one is dropped as is)
        self.worker.progress()

    def new_tag_base(self) -> int:
        self._channels += 1
        return self._channels << CHANNEL_SHIFT

    def _tag(self, base: int, region: int, j: int) -> object:
        return self.ucx.UCXXTag(base | (region << REGION_SHIFT) | j)

    def write(self, agent: str, job: WriteJob) -> _Requests:
        ep = self.eps[agent]
        pairs = [p for _, p in job.pairs]
        index = [i for i, _ in job.pairs]
        reg, so, _, ln = expand_arrays(
            pairs, job.src_blocks, job.dst_blocks, job.src_slot, job.dst_slot, job.stage_slot
        )
        reqs, keep, j, last = [], [], 0, -1
        for r, s, n in zip(reg.tolist(), so.tolist(), ln.tolist()):
            j = j + 1 if r == last else 0
            last = r
            p = pairs[r]
            buf = self.views[src_key(p)][s : s + n]
            keep.append(buf)
            reqs.append(ep.tag_send(self.Array(buf), self._tag(job.tag_base, index[r], j)))
        return _Requests(agent, reqs, keep, job.notif)

    def expect(
        self,
        agent: str,
        pairs: Sequence[RegionPair],
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        src_slot: int,
        dst_slot: int,
        tag_base: int,
    ) -> _Requests:
        ep = self.eps[agent]
        reg, _, do, ln = expand_arrays(pairs, src_blocks, dst_blocks, src_slot, dst_slot)
        reqs, keep, j, last = [], [], 0, -1
        for r, d, n in zip(reg.tolist(), do.tolist(), ln.tolist()):
            j = j + 1 if r == last else 0
            last = r
            p = pairs[r]
            buf = self.views[(p.layer, p.kind)][d : d + n]
            keep.append(buf)
            reqs.append(ep.tag_recv(self.Array(buf), self._tag(tag_base, r, j)))
        return _Requests(agent, reqs, keep, None)

    def drain(
        self,
        agent: str,
        pairs: Sequence[tuple[int, RegionPair]],
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        src_slot: int,
        dst_slot: int,
        tag_base: int,
    ) -> None:
        """Empty messages for the ranges of `pairs` the receiver still waits for."""
        ep = self.eps.get(agent)
        if ep is None or not pairs:
            return None
        reg, _, _, _ = expand_arrays([p for _, p in pairs], src_blocks, dst_blocks, src_slot, dst_slot)
        j, last = 0, -1
        for r in reg.tolist():
            j = j + 1 if r == last else 0
            last = r
            self._sends.append((ep.tag_send(self.Array(self._empty), self._tag(tag_base, pairs[r][0], j)), None))
        return None

    def _settle(self, h: _Requests) -> TransferState:
        if h.error is not None:
            return TransferState.FAILED
        self.worker.progress()
        if not all(r.completed for r in h.reqs):
            return TransferState.TRANSFERRING
        for r in h.reqs:
            try:
                r.check_error()
            except Exception as e:  # noqa: BLE001 (UCX errors: peer gone, canceled, truncated)
                h.error = f"{type(e).__name__}: {e}"
                return TransferState.FAILED
        if h.notif is not None:
            try:
                self.send_control(h.agent, h.notif)
            except KeyError as e:
                h.error = str(e)
                return TransferState.FAILED
            h.notif = None
        return TransferState.DONE

    def state(self, handle: object) -> TransferState:
        return self._settle(_requests(handle))

    def expect_state(self, handle: object | None) -> TransferState:
        return TransferState.DONE if handle is None else self._settle(_requests(handle))

    def release(self, handle: object, force: bool = False) -> bool:
        if handle is None:
            return True
        h = _requests(handle)
        if self._settle(h) is TransferState.TRANSFERRING and not force:
            return False
        h.keep.clear()
        return True

    def send_control(self, agent: str, payload: bytes) -> None:
        ep = self.eps.get(agent)
        if ep is None:
            raise KeyError(f"no UCX endpoint to {agent}")
        buf = np.frombuffer(bytes(payload), dtype=np.uint8).copy()
        self._sends.append((ep.tag_send(self.Array(buf), self.ucx.UCXXTag(CONTROL_TAG)), buf))

    def progress(self) -> None:
        self.worker.progress()
        self._sends = [(r, b) for r, b in self._sends if not r.completed]

    def poll_control(self) -> list[bytes]:
        self.worker.progress()
        while True:
            probe = self.worker.tag_probe(self.ucx.UCXXTag(CONTROL_TAG), remove=True)
            if not probe.matched:
                break
            buf = np.empty(probe.length, dtype=np.uint8)
            self._ctl_recvs.append((self.worker.tag_recv_with_handle(self.Array(buf), probe), buf))
        out: list[bytes] = []
        while self._ctl_recvs and self._ctl_recvs[0][0].completed:
            req, buf = self._ctl_recvs.popleft()
            try:
                req.check_error()
                out.append(buf.tobytes())
            except Exception as e:  # noqa: BLE001
                log.warning("UCXX control message lost: %s", e)
        return out

    def close(self) -> None:
        for agent in list(self.eps):
            self.remove_peer(agent)

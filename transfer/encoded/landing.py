"""The prefill node's side of the encoder-output transfer: one host region registered once with
a NIXL agent of its own, cut into slots on request (ReserveEncoded: one slot per image the node
has not encoded, under a lease), written by encode nodes and announced by an `EncodedOutput`
notification. `take` checks that record against the slot and the node's model (kind, version,
digest, dtype, shape, offsets within the slot, crc32) and hands back the tensors, freeing the
slot; a slot never written is freed when its lease ends. Anything that does not check out is
dropped with a log line and the prefill encodes the image itself.

Thread-safe: the node's RPC threads reserve and take. A progress thread of its own drives the
agent (UCX needs the target side progressed for a WRITE to complete) only while a slot waits for
its bytes, and sleeps otherwise."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.config import dtype_name
from engine.vision.embedder import put_encoded
from transfer.backend import host_bytes
from transfer.encoded.messages import (
    ENCODED_VERSION,
    EncodedOutput,
    LandingSlot,
    LandingTarget,
    decode_output,
)
from transfer.netif import ucx_net_devices
from transfer.nixl_api import nixl_api

if TYPE_CHECKING:
    from engine.core import EngineCore

log = logging.getLogger("pdserve.encoded")

ALIGN = 64  # slot offsets are multiples of this many bytes


@dataclass
class _Slot:
    slot: LandingSlot
    expires: float
    landed: EncodedOutput | None = None


@dataclass(frozen=True)
class Landed:
    """One image's encoder output taken from the region (copies: the slot is free again)."""

    pixel_hash: bytes
    embeddings: torch.Tensor  # [tokens, hidden] in the model's dtype
    deepstack: tuple[torch.Tensor, ...]
    src: str  # the encode node


class Landing:
    def __init__(
        self,
        node: str,
        region_bytes: int,
        digest: str,
        dtype: torch.dtype,
        hidden: int,
        tp_size: int,
        bind_host: str | None = "127.0.0.1",
    ) -> None:
        nixl_agent, nixl_agent_config = nixl_api()

        if region_bytes <= 0:
            raise ValueError(f"the landing region needs a positive size (got {region_bytes})")
        self.node, self.digest, self.dtype, self.hidden, self.tp_size = node, digest, dtype, hidden, tp_size
        self.incarnation = int.from_bytes(os.urandom(7), "little")
        self.agent = f"{node}.landing.{self.incarnation:x}"
        self.region = torch.zeros(region_bytes, dtype=torch.uint8)
        with ucx_net_devices(bind_host):
            self.nx = nixl_agent(self.agent, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        rows = np.array([(self.region.data_ptr(), region_bytes, 0)], dtype=np.uint64)
        self._reg = self.nx.register_memory(rows, "DRAM")
        self._lock = threading.Lock()
        self._slots: dict[bytes, _Slot] = {}  # by pixel hash: one slot per image at a time
        self.dropped = 0  # notifications that did not check out
        self._waiting = threading.Condition(self._lock)  # notified when a slot is reserved
        self._closed = False
        self._thread = threading.Thread(target=self._progress, name=f"{node}-landing", daemon=True)
        self._thread.start()

    def _progress(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not any(s.landed is None for s in self._slots.values()):
                    self._waiting.wait()
                if self._closed:
                    return
            self.poll()
            time.sleep(0.001)  # polls while outputs are awaited: a millisecond apart, not a busy core

    # ---- reserve ------------------------------------------------------------------------------
    def slot_bytes(self, tokens: int) -> int:
        return tokens * self.hidden * self.dtype.itemsize

    def reserve(self, wants: list[tuple[bytes, int]], lease_s: float) -> LandingTarget:
        """Slots for (pixel hash, tokens) pairs, as many as fit in order (an image that already has
        a slot keeps it and is not named again); the target may hold fewer slots than asked."""
        now = time.monotonic()
        out: list[LandingSlot] = []
        with self._lock:
            self._expire(now)
            for key, tokens in wants:
                if key in self._slots:
                    continue
                n = self.slot_bytes(tokens)
                at = self._fit(n)
                if at is None:
                    break
                s = LandingSlot(key, at, n)
                self._slots[key] = _Slot(s, now + lease_s)
                out.append(s)
            if out:
                self._waiting.notify()
        return LandingTarget(
            ENCODED_VERSION,
            self.node,
            self.agent,
            self.nx.get_agent_metadata(),
            self.incarnation,
            self.region.data_ptr(),
            self.region.numel(),
            self.digest,
            dtype_name(self.dtype),
            self.hidden,
            self.tp_size,
            lease_s,
            out,
        )

    def _fit(self, n: int) -> int | None:
        """First fit among the slots in use (under the lock)."""
        used = sorted((s.slot.offset, s.slot.offset + s.slot.nbytes) for s in self._slots.values())
        at = 0
        for lo, hi in used:
            if at + n <= lo:
                return at
            at = max(at, -(-hi // ALIGN) * ALIGN)
        return at if at + n <= self.region.numel() else None

    def _expire(self, now: float) -> None:
        for key in [k for k, s in self._slots.items() if s.expires < now]:
            del self._slots[key]  # a late WRITE lands in room no one uses until a new reserve (see docs)

    def release(self, keys: list[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._slots.pop(k, None)

    # ---- land ---------------------------------------------------------------------------------
    def poll(self) -> None:
        """Progress the agent, read the notifications that arrived; mark the slots whose record
        checks out."""
        with self._lock:
            self._expire(time.monotonic())
            notifs = self.nx.get_new_notifs()
            for msgs in notifs.values():
                for raw in msgs:
                    msg = decode_output(raw)
                    if msg is None:
                        continue
                    s = self._slots.get(msg.pixel_hash)
                    err = "no slot for it" if s is None else self._check(msg, s.slot)
                    if err:
                        self.dropped += 1
                        log.warning("encoder output from %s dropped: %s", msg.src, err)
                        if s is not None:
                            del self._slots[msg.pixel_hash]
                        continue
                    assert s is not None
                    s.landed = msg

    def _check(self, msg: EncodedOutput, slot: LandingSlot) -> str:
        """Why the record cannot be used ("" when it can)."""
        want_dtype = dtype_name(self.dtype)
        if msg.version != ENCODED_VERSION or msg.kind != "encoder_output":
            return f"version {msg.version} kind {msg.kind!r}, expected {ENCODED_VERSION} 'encoder_output'"
        if msg.incarnation != self.incarnation:
            return f"written for landing incarnation {msg.incarnation:x}, this is {self.incarnation:x}"
        if msg.digest != self.digest:
            return f"vision digest {msg.digest} differs from this node's {self.digest}"
        if not msg.replicated or msg.tp_rank >= msg.tp_size:
            return f"a shard (tp rank {msg.tp_rank} of {msg.tp_size}); this node takes whole outputs"
        emb = [t for t in msg.tensors if t.name == "embeddings"]
        if len(emb) != 1:
            return "no embeddings tensor"
        t0 = emb[0]
        if t0.dtype != want_dtype or len(t0.shape) != 2 or t0.shape[1] != self.hidden or t0.axes != ["token", "hidden"]:
            return f"embeddings {t0.dtype} {t0.shape} {t0.axes}, expected {want_dtype} [tokens, {self.hidden}]"
        end = slot.offset + slot.nbytes
        for t in msg.tensors:
            dt = _dtype(t.dtype)
            size = -1 if dt is None else math.prod(t.shape) * dt.itemsize
            if size != t.nbytes or t.offset < slot.offset or t.offset + t.nbytes > end:
                return f"tensor {t.name} {t.shape} at {t.offset}+{t.nbytes} does not fit its slot {slot.offset}+{slot.nbytes}"
        return ""

    def take(self, key: bytes, wait_s: float) -> Landed | None:
        """The image's landed output (its slot freed), waiting up to wait_s for its notification;
        None when it has no slot, or nothing checked out in time (the slot is then freed)."""
        deadline = time.monotonic() + wait_s
        while True:
            self.poll()
            with self._lock:
                s = self._slots.get(key)
                if s is None:
                    return None
                if s.landed is not None:
                    del self._slots[key]
                    return self._copy(s.landed, s.slot)
                if time.monotonic() >= deadline:
                    del self._slots[key]
                    return None
            time.sleep(0.001)

    def _copy(self, msg: EncodedOutput, slot: LandingSlot) -> Landed | None:
        """The tensors, copied out of the slot; None (logged) when the copy's crc32 is not the
        sender's: the bytes used are the bytes checked (under the lock)."""
        raw = self.region[slot.offset : slot.offset + slot.nbytes].clone()
        got = zlib.crc32(host_bytes(raw[: sum(t.nbytes for t in msg.tensors)]))
        if got != msg.crc32:
            self.dropped += 1
            log.warning(
                "encoder output from %s dropped: crc32 %08x of the slot, the sender's %08x", msg.src, got, msg.crc32
            )
            return None
        tensors = {}
        for t in msg.tensors:
            at = t.offset - slot.offset
            tensors[t.name] = raw[at : at + t.nbytes].view(_dtype(t.dtype)).reshape(t.shape)  # type: ignore[arg-type]
        deep = tuple(tensors[k] for k in sorted(k for k in tensors if k.startswith("deepstack.")))
        return Landed(msg.pixel_hash, tensors["embeddings"], deep, msg.src)

    def pending(self) -> int:
        with self._lock:
            return len(self._slots)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._waiting.notify()
        self._thread.join(timeout=5)
        try:
            self.nx.deregister_memory(self._reg)
        except Exception as e:  # noqa: BLE001 (NIXL raises its own error types)
            log.warning("NIXL deregister of the landing region: %s", e)


def _dtype(name: str) -> torch.dtype | None:
    d = getattr(torch, name, None)
    return d if isinstance(d, torch.dtype) else None


def install(engine: EngineCore, landed: Landed) -> bool:
    """Put a landed output into every rank's encoder cache (on the engine loop's thread): the
    prefill then finds it there, as it finds an image it encoded itself. False when a rank
    would not take it."""
    return all(engine.executor.call_all(put_encoded, landed.pixel_hash, landed.embeddings))

"""The encode node's side of the encoder-output transfer: a host staging region registered once
with the node's NIXL agent; `push` copies one image's output into it, WRITEs it into the prefill
node's landing slot with the `EncodedOutput` record as the notification that follows the bytes,
and waits for the WRITE to complete. One push at a time (the staging region is one); a landing
agent is added on first use and replaced when its node comes back as a new incarnation."""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib

import numpy as np
import torch

from engine.config import dtype_name
from transfer.backend import host_bytes
from transfer.encoded.messages import ENCODED_VERSION, EncodedOutput, EncodedTensor, LandingSlot, LandingTarget
from transfer.encoded.messages import encode_output as encode_record
from transfer.netif import ucx_net_devices
from transfer.nixl_api import nixl_api

log = logging.getLogger("pdserve.encoded")


class PushError(RuntimeError):
    """A push that did not land (refused target, NIXL error, timeout): the prefill node encodes."""


class Pusher:
    def __init__(self, node: str, staging_bytes: int, digest: str, bind_host: str | None = "127.0.0.1") -> None:
        nixl_agent, nixl_agent_config = nixl_api()

        self.node, self.digest = node, digest
        self.agent = f"{node}.{int.from_bytes(os.urandom(7), 'little'):x}"
        self.staging = torch.zeros(staging_bytes, dtype=torch.uint8)
        with ucx_net_devices(bind_host):
            self.nx = nixl_agent(self.agent, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self._reg = self.nx.register_memory(np.array([(self.staging.data_ptr(), staging_bytes, 0)], np.uint64), "DRAM")
        self._lock = threading.Lock()
        self._peers: dict[str, str] = {}  # prefill node -> its landing agent added here

    def check(self, target: LandingTarget, dtype: torch.dtype, hidden: int) -> None:
        """PushError unless this node's output fits the target's model."""
        if target.version != ENCODED_VERSION:
            raise PushError(f"landing version {target.version}, this node speaks {ENCODED_VERSION}")
        if target.digest != self.digest:
            raise PushError(f"vision digest {target.digest} of {target.node} differs from this node's {self.digest}")
        if target.dtype != dtype_name(dtype) or target.hidden != hidden:
            raise PushError(
                f"{target.node} takes {target.dtype} [*, {target.hidden}], this node makes "
                f"{dtype_name(dtype)} [*, {hidden}]"
            )

    def _peer(self, target: LandingTarget) -> None:
        old = self._peers.get(target.node)
        if old == target.agent:
            return
        if old is not None:
            try:
                self.nx.remove_remote_agent(old)
            except Exception as e:  # noqa: BLE001 (NIXL raises its own error types)
                log.warning("NIXL remove_remote_agent(%s): %s", old, e)
        name = self.nx.add_remote_agent(target.metadata)
        name = name.decode() if isinstance(name, bytes) else name
        if name != target.agent:
            self.nx.remove_remote_agent(name)
            raise PushError(f"landing metadata names agent {name!r}, the target said {target.agent!r}")
        self._peers[target.node] = target.agent

    def push(
        self,
        target: LandingTarget,
        slot: LandingSlot,
        grid_thw: list[int],
        embeddings: torch.Tensor,
        timeout_s: float,
        deepstack: tuple[torch.Tensor, ...] = (),
    ) -> int:
        """WRITE one image's output into `slot` and notify; the bytes written (PushError on failure)."""
        parts = [("embeddings", embeddings), *((f"deepstack.{i}", t) for i, t in enumerate(deepstack))]
        nbytes = sum(t.numel() * t.element_size() for _, t in parts)
        if nbytes > slot.nbytes or nbytes > self.staging.numel():
            raise PushError(
                f"output of {nbytes} B does not fit the slot ({slot.nbytes} B) or staging ({self.staging.numel()} B)"
            )
        with self._lock:
            self._peer(target)
            descs, at = [], 0
            for name, t in parts:
                flat = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
                self.staging[at : at + flat.numel()].copy_(flat)
                descs.append(
                    EncodedTensor(
                        name, dtype_name(t.dtype), list(t.shape), ["token", "hidden"], slot.offset + at, flat.numel()
                    )
                )
                at += flat.numel()
            record = EncodedOutput(
                ENCODED_VERSION,
                "encoder_output",
                target.incarnation,
                self.node,
                slot.pixel_hash,
                list(grid_thw),
                self.digest,
                1,
                0,
                True,
                descs,
                zlib.crc32(host_bytes(self.staging[:nbytes])),
            )
            self._write(target, slot, nbytes, encode_record(record), timeout_s)
        return nbytes

    def _write(self, target: LandingTarget, slot: LandingSlot, nbytes: int, notif: bytes, timeout_s: float) -> None:
        local = self.nx.get_xfer_descs(np.array([(self.staging.data_ptr(), nbytes, 0)], np.uint64), "DRAM")
        remote = self.nx.get_xfer_descs(np.array([(target.base_addr + slot.offset, nbytes, 0)], np.uint64), "DRAM")
        h = self.nx.initialize_xfer("WRITE", local, remote, target.agent, notif)
        try:
            if self.nx.transfer(h) == "ERR":
                raise PushError(f"NIXL refused a WRITE of {nbytes} B to {target.agent}")
            deadline = time.monotonic() + timeout_s
            while (state := self.nx.check_xfer_state(h)) == "PROC":
                if time.monotonic() > deadline:
                    raise PushError(f"the WRITE to {target.node} did not complete within {timeout_s} s")
                time.sleep(0.0002)
            if state != "DONE":
                raise PushError(f"the WRITE to {target.node} failed ({state})")
        finally:
            try:
                self.nx.release_xfer_handle(h)
            except Exception as e:  # noqa: BLE001 (one still in flight after a timeout)
                log.warning("NIXL could not release a WRITE to %s: %s", target.node, e)
                self.forget(target.node)

    def forget(self, node: str) -> None:
        """Drop a landing agent (its node failed a push): the next push adds it afresh."""
        agent = self._peers.pop(node, None)
        if agent is not None:
            try:
                self.nx.remove_remote_agent(agent)
            except Exception as e:  # noqa: BLE001
                log.warning("NIXL remove_remote_agent(%s): %s", agent, e)

    def close(self) -> None:
        for node in list(self._peers):
            self.forget(node)
        try:
            self.nx.deregister_memory(self._reg)
        except Exception as e:  # noqa: BLE001
            log.warning("NIXL deregister of the staging region: %s", e)

"""The prefill node's gRPC server: `serve(addr, cfg) -> (node, port)`. A STUB for now.

It serves PrefillNode (+ health and reflection), registers with the router as a prefill node
with `prefill_ready=False` and heartbeats, so pools, registration and shutdown can be exercised;
Prefill / Abort / Handshake answer UNIMPLEMENTED. The router never routes to a node that is not
prefill_ready. What comes next (issue 5): an EngineCore with `prefill_only=True` requests (hold
pages + slot after the first token), a transfer Sender per rank fed by the request's
TransferTarget, first token + timings in PrefillResponse, Abort -> sender abort + engine release.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

import grpc

from proto import pb, rpc
from proto.serving import Heartbeater, start_server

log = logging.getLogger("pdserve.prefill")


@dataclass(frozen=True)
class PrefillNodeConfig:
    model: str  # checkpoint directory
    node_id: str = "prefill-0"
    tensor_parallel_size: int = 1
    router: str | None = None  # host:port of the router to register with
    advertise_host: str = "127.0.0.1"
    heartbeat_interval_s: float = 0.5


class PrefillNode(rpc.PrefillNodeServicer):
    def __init__(self, cfg: PrefillNodeConfig):
        from engine.config import ModelConfig

        self.cfg = cfg
        self.model = ModelConfig.from_dir(cfg.model)  # checks the checkpoint; no weights loaded
        self.incarnation = int.from_bytes(os.urandom(7), "little")
        self.address = ""
        self.server = None
        self._health = None
        self._hb = None
        self._stopped = threading.Event()

    def info(self) -> pb.NodeInfo:
        return pb.NodeInfo(
            node_id=self.cfg.node_id,
            kind=pb.NODE_KIND_PREFILL,
            address=self.address,
            incarnation=self.incarnation,
            tp_size=self.cfg.tensor_parallel_size,
            model=self.cfg.model,
            vocab_size=self.model.vocab_size,
            max_model_len=self.model.max_position_embeddings,
            prefill_ready=False,
            capacity=pb.Capacity(),
        )

    def Stats(self, request, context):
        return self.info()

    def Prefill(self, request, context):
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "the prefill pool is not available yet (stub prefill node)")

    def Abort(self, request, context):
        return pb.AbortResponse(aborted=False)

    def Handshake(self, request, context):
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "the transfer endpoint is not wired on prefill nodes yet")

    def start(self, addr: str) -> int:
        self.server, port, self._health = start_server(
            addr, lambda s: rpc.add_PrefillNodeServicer_to_server(self, s), ["PrefillNode"], max_workers=16
        )
        self.address = f"{self.cfg.advertise_host}:{port}"
        if self.cfg.router:
            self._hb = Heartbeater(self.cfg.router, self.info, self.cfg.heartbeat_interval_s).start()
        log.info("prefill node %s (stub) serving on %s", self.cfg.node_id, self.address)
        return port

    def stop(self, grace: float | None = 2.0) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._health is not None:
            self._health.enter_graceful_shutdown()
        if self._hb is not None:
            self._hb.stop()
        if self.server is not None:
            self.server.stop(grace).wait(timeout=(grace or 0) + 5)

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self.server.wait_for_termination(timeout)


def serve(addr: str, cfg: PrefillNodeConfig) -> tuple[PrefillNode, int]:
    node = PrefillNode(cfg)
    return node, node.start(addr)

"""A fake decode node for the router's tests: a real gRPC server whose Generate streams the tokens
of a list, one every `delay_s` seconds, and records how each call ended; `heartbeat` keeps it
registered with a router as a real node does (serving.rpc.Heartbeater)."""

from __future__ import annotations

import threading
import time

from proto import pb, rpc
from serving.rpc import Heartbeater


class FakeDecode(rpc.DecodeNodeServicer):
    def __init__(self, tokens: list[int], delay_s: float = 0.02):
        self.tokens = tokens  # streamed in turn
        self.delay_s = delay_s
        self.calls: list[str] = []  # how each Generate ended: "done" or "cancelled"
        self.started = 0  # Generate calls received
        self.max_model_len = 512  # decode_info's default
        self.last = None
        self.seen: list = []  # every DecodeRequest received, in order
        self.lock = threading.Lock()

    def Generate(self, request, context):
        ended = threading.Event()
        with self.lock:
            self.started += 1
            self.last = request  # the DecodeRequest as the router sent it
            self.seen.append(request)

        def cancelled():
            if not ended.is_set():
                with self.lock:
                    self.calls.append("cancelled")

        context.add_callback(cancelled)
        # as a real node: at most what its context (decode_info's max_model_len) leaves after the prompt
        # a resumed request goes on after the tokens it has (max_tokens counts them), as a real node
        off = len(request.resume_token_ids)
        n = min(request.sampling.max_tokens or 16, self.max_model_len - len(request.prompt_token_ids))
        for i in range(off, n):
            time.sleep(self.delay_s)
            if not context.is_active():
                return
            yield pb.GenerateResponse(
                token_ids=[self.tokens[i % len(self.tokens)]], finish_reason="length" if i == n - 1 else ""
            )
        ended.set()
        with self.lock:
            self.calls.append("done")


def decode_info(
    address: str, node_id: str = "d0", slots: int = 8, max_model_len: int = 512, vocab_size: int = 100
) -> pb.NodeInfo:
    cap = pb.Capacity(total_blocks=100, free_blocks=100, block_size=16, total_slots=slots, free_slots=slots)
    return pb.NodeInfo(
        node_id=node_id,
        kind=pb.NODE_KIND_DECODE,
        address=address,
        incarnation=1,
        model="/models/m",
        vocab_size=vocab_size,
        max_model_len=max_model_len,
        capacity=cap,
    )


def heartbeat(router_addr: str, info: pb.NodeInfo, interval_s: float) -> Heartbeater:
    """Register `info` with the router and heartbeat it from a thread (stop() ends it)."""
    return Heartbeater(router_addr, lambda: info, interval_s).start()

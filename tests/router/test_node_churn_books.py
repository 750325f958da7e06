"""What the router keeps per node goes with the node: a prefill node that restarts (a new
incarnation under the same id) or that the registry forgets (a pool scaled down, a pod replaced)
leaves no handshaken pair, pair lock or measured rate behind, so a router that outlives many node
restarts keeps these books at the size of its live cluster."""

from __future__ import annotations

import asyncio

from proto import pb
from tests.helpers.fake_node import decode_info
from tests.helpers.serve_harness import wait_for


def _prefill(node_id: str, incarnation: int) -> pb.NodeInfo:
    cap = pb.Capacity(total_blocks=100, free_blocks=100, block_size=16, total_slots=8, free_slots=8)
    return pb.NodeInfo(
        node_id=node_id,
        kind=pb.NODE_KIND_PREFILL,
        address="127.0.0.1:9",  # never called: the pairs are noted by hand below
        incarnation=incarnation,
        model="/models/m",
        vocab_size=100,
        max_model_len=512,
        capacity=cap,
    )


def test_restarted_and_forgotten_nodes_leave_no_pairs_or_rates(ckpt):
    from router.server import RouterConfig, serve

    cfg = RouterConfig(model=str(ckpt), heartbeat_interval_s=0.05, dead_after_s=1.0)
    r, _ = serve("127.0.0.1:0", cfg)
    try:
        r.registry.forget_after_s = 0.2
        prefill = r.prefill
        d = r.registry.register(decode_info("127.0.0.1:8", node_id="d0"))

        def restart(incarnation: int) -> None:
            """p0 registers (again) and is handshaken with d0 and measured, as a request does."""
            p = r.registry.register(_prefill("p0", incarnation))
            key = prefill._pair_key(p, d)
            prefill._pairs.add(key)
            prefill._pair_locks[key] = asyncio.Lock()
            prefill.meter.busy("p0")
            prefill.meter.done("p0", 64)

        for inc in range(1, 21):  # twenty restarts of p0 while d0 lives on
            restart(inc)
        key = (("p0", 20, "d0", 1),)
        wait_for(lambda: set(prefill._pair_locks) == set(key), 5, "only the live pair's lock kept")
        assert prefill._pairs == set(key)
        assert prefill.meter.since("p0") > 0  # the live node keeps its measurement
        # p0 stops heartbeating: declared dead, then forgotten; nothing of it is kept
        wait_for(lambda: "p0" not in r.registry.nodes, 5, "p0 forgotten")
        wait_for(lambda: not prefill._pair_locks and not prefill._pairs, 5, "its pairs dropped")
        assert prefill.meter.rate("p0") is None and prefill.meter.since("p0") == 0.0
    finally:
        r.stop(0)

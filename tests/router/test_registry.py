"""The router's registry and policy, in process, with fake nodes: registration, heartbeats,
death after missed heartbeats, re-registration of a new incarnation, static nodes polled with
Stats, draining and unreachable nodes (alive, not routable), and the least-loaded choice. Plus the pools file of `pdserve up`."""

from __future__ import annotations

import time

import pytest

from proto import pb, rpc
from serving.rpc import channel, start_server
from tests.helpers.serve_harness import wait_for


def _info(node_id, address, inc=1, free_slots=8, free_blocks=100, running=0, kind=pb.NODE_KIND_DECODE):
    return pb.NodeInfo(
        node_id=node_id,
        kind=kind,
        address=address,
        incarnation=inc,
        tp_size=1,
        model="/m",
        vocab_size=1024,
        max_model_len=4096,
        capacity=pb.Capacity(
            total_blocks=100,
            free_blocks=free_blocks,
            block_size=16,
            total_slots=8,
            free_slots=free_slots,
            running=running,
        ),
    )


@pytest.fixture()
def router():
    from router.server import RouterConfig, serve

    r, port = serve("127.0.0.1:0", RouterConfig(heartbeat_interval_s=0.1, dead_after_s=0.5, admission_timeout_s=0.2))
    ch = channel(f"127.0.0.1:{port}")
    yield r, rpc.RegistryStub(ch)
    ch.close()
    r.stop(0)


def _alive(stub) -> dict[str, bool]:
    return {n.node.node_id: n.alive for n in stub.ListNodes(pb.ListNodesRequest(), timeout=5).nodes}


def test_register_heartbeat_death_and_new_incarnation(router):
    r, stub = router
    hb = stub.Register(pb.RegisterRequest(node=_info("d0", "127.0.0.1:1")), timeout=5)
    assert hb.heartbeat_interval_s == pytest.approx(0.1)
    assert _alive(stub) == {"d0": True}
    for _ in range(8):  # heartbeats keep it alive past dead_after_s
        assert stub.Heartbeat(pb.HeartbeatRequest(node_id="d0", incarnation=1, capacity=pb.Capacity()), timeout=5).known
        time.sleep(0.1)
    assert _alive(stub) == {"d0": True}
    wait_for(lambda: _alive(stub) == {"d0": False}, 5, "d0 marked dead")
    # a heartbeat from an unknown id or an old incarnation asks the node to register again
    assert not stub.Heartbeat(pb.HeartbeatRequest(node_id="nope", incarnation=1), timeout=5).known
    stub.Register(pb.RegisterRequest(node=_info("d0", "127.0.0.1:1", inc=2)), timeout=5)
    assert not stub.Heartbeat(pb.HeartbeatRequest(node_id="d0", incarnation=1), timeout=5).known
    assert stub.Heartbeat(pb.HeartbeatRequest(node_id="d0", incarnation=2, capacity=pb.Capacity()), timeout=5).known
    assert _alive(stub)["d0"]


def test_a_node_dead_long_enough_is_forgotten_and_may_register_again(router):
    """A node dead for the registry's forget_after_s (a pool scaled down) leaves `pdserve nodes`;
    its heartbeat, if it comes back, asks it to register again, and it does."""
    r, stub = router
    r.service.registry.forget_after_s = 1.0
    stub.Register(pb.RegisterRequest(node=_info("d9", "127.0.0.1:9")), timeout=5)
    wait_for(lambda: _alive(stub) == {"d9": False}, 5, "d9 marked dead")
    wait_for(lambda: _alive(stub) == {}, 5, "d9 forgotten")
    assert not stub.Heartbeat(pb.HeartbeatRequest(node_id="d9", incarnation=1), timeout=5).known
    stub.Register(pb.RegisterRequest(node=_info("d9", "127.0.0.1:9")), timeout=5)
    assert _alive(stub) == {"d9": True}


def test_draining_node_is_alive_but_not_routable(router):
    r, stub = router
    for nid in ("d0", "d1"):
        stub.Register(pb.RegisterRequest(node=_info(nid, "127.0.0.1:1")), timeout=5)
    assert stub.Heartbeat(
        pb.HeartbeatRequest(node_id="d0", incarnation=1, capacity=_info("d0", "").capacity, draining=True), timeout=5
    ).known
    listed = {n.node.node_id: (n.alive, n.node.draining) for n in stub.ListNodes(pb.ListNodesRequest()).nodes}
    assert listed == {"d0": (True, True), "d1": (True, False)}
    assert [e.node_id for e in r.registry.routable(pb.NODE_KIND_DECODE)] == ["d1"]
    assert {e.node_id for e in r.registry.live(pb.NODE_KIND_DECODE)} == {"d0", "d1"}
    # a refusal marks a node draining before its heartbeat says so; a heartbeat without it clears it
    r.registry.mark_draining(r.registry.nodes["d1"])
    assert r.registry.routable(pb.NODE_KIND_DECODE) == []
    stub.Heartbeat(pb.HeartbeatRequest(node_id="d1", incarnation=1, capacity=_info("d1", "").capacity), timeout=5)
    assert [e.node_id for e in r.registry.routable(pb.NODE_KIND_DECODE)] == ["d1"]


def test_a_draining_node_that_goes_quiet_is_no_warning(router, caplog):
    """A node that stops at the end of its drain (every clean shutdown, `pdserve up`'s Ctrl-C) was
    logged at WARNING like a node that died; now at INFO, saying it was draining."""
    import logging

    r, stub = router
    for nid in ("d0", "d1"):
        stub.Register(pb.RegisterRequest(node=_info(nid, "127.0.0.1:1")), timeout=5)
    stub.Heartbeat(pb.HeartbeatRequest(node_id="d0", incarnation=1, capacity=pb.Capacity(), draining=True), timeout=5)
    with caplog.at_level(logging.INFO, logger="pdserve.router"):
        wait_for(lambda: _alive(stub) == {"d0": False, "d1": False}, 5, "both marked dead")
        time.sleep(0.2)
    levels = {
        rec.getMessage().split(" ")[1]: rec.levelno for rec in caplog.records if "marked dead" in rec.getMessage()
    }
    assert levels == {"d0": logging.INFO, "d1": logging.WARNING}, levels


def test_unreachable_node_is_alive_but_not_routable_until_it_reports(router):
    """A call that found a node gone keeps new requests off it at once (not after the heartbeats'
    dead_after), leaves it live for the calls it has, and its next heartbeat brings it back."""
    r, stub = router
    for nid in ("d0", "d1"):
        stub.Register(pb.RegisterRequest(node=_info(nid, "127.0.0.1:1")), timeout=5)
    r.registry.mark_unreachable(r.registry.nodes["d0"], "connection refused")
    assert [e.node_id for e in r.registry.routable(pb.NODE_KIND_DECODE)] == ["d1"]
    assert {e.node_id for e in r.registry.live(pb.NODE_KIND_DECODE)} == {"d0", "d1"}
    stub.Heartbeat(pb.HeartbeatRequest(node_id="d0", incarnation=1, capacity=_info("d0", "").capacity), timeout=5)
    assert {e.node_id for e in r.registry.routable(pb.NODE_KIND_DECODE)} == {"d0", "d1"}


def test_decode_node_prefills_when_every_prefill_node_is_loaded():
    """--max-prefill-queue-tokens: the prefill pool is used until every ready prefill node has that
    many prompt tokens queued (reported, plus what the router itself sent since)."""
    from router.server import RouterConfig, serve

    r, port = serve("127.0.0.1:0", RouterConfig(max_prefill_queue_tokens=1000))
    try:
        d = r.registry.register(_info("d0", "127.0.0.1:1"))
        d.info.schema_digest = "x"
        p0 = _info("p0", "127.0.0.1:2", kind=pb.NODE_KIND_PREFILL)
        p0.schema_digest, p0.prefill_ready, p0.capacity.queued_prefill_tokens = "x", True, 500
        e0 = r.registry.register(p0)
        assert r.prefill.use_pool(d, 64)
        e0.inflight_prefill_tokens = 600  # sent by the router since p0's report: 1100 queued
        assert not r.prefill.use_pool(d, 64)
        p1 = _info("p1", "127.0.0.1:3", kind=pb.NODE_KIND_PREFILL)
        p1.schema_digest, p1.prefill_ready = "x", True
        r.registry.register(p1)
        assert r.prefill.use_pool(d, 64)  # one prefill node has room
        # a conversation's next turn held on d (cached tokens there): pooled from its resume threshold on
        d.info.local_resume_threshold = 64
        assert not r.prefill.use_pool(d, 63, cached=400)
        assert r.prefill.use_pool(d, 64, cached=400)
        assert r.prefill.use_pool(d, 63)  # nothing cached on d: the pool
        d.info.local_resume_threshold = 0
        assert r.prefill.use_pool(d, 1, cached=400)
    finally:
        r.stop(0)
    with pytest.raises(ValueError, match="max_prefill_queue_tokens"):
        RouterConfig(max_prefill_queue_tokens=-1)


def test_registration_needs_id_and_address(router):
    import grpc

    _, stub = router
    with pytest.raises(grpc.RpcError) as ei:
        stub.Register(pb.RegisterRequest(node=pb.NodeInfo(node_id="x")), timeout=5)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_least_loaded_policy():
    from router.policy import make_policy
    from router.registry import NodeEntry

    pol = make_policy("least-loaded")
    a = NodeEntry(_info("a", "x:1", free_slots=2, free_blocks=90))
    b = NodeEntry(_info("b", "x:2", free_slots=6, free_blocks=90))
    c = NodeEntry(_info("c", "x:3", free_slots=6, free_blocks=90, running=1))
    assert pol.choose_decode([a, b, c], 10) is b  # most free, then the smaller batch
    b.inflight = 5  # the router's own in-flight requests count before the next heartbeat
    assert pol.choose_decode([a, b, c], 10) is c
    full = NodeEntry(_info("f", "x:4", free_slots=0))
    assert pol.choose_decode([full], 10) is None
    small = NodeEntry(_info("s", "x:5", free_blocks=2))
    assert pol.choose_decode([small], 16) is not None and pol.choose_decode([small], 32) is None  # 33 tokens: 3 blocks
    p1 = NodeEntry(_info("p1", "x:6", kind=pb.NODE_KIND_PREFILL))
    p2 = NodeEntry(_info("p2", "x:7", kind=pb.NODE_KIND_PREFILL))
    p1.info.capacity.queued_prefill_tokens = 500
    assert pol.choose_prefill([p1, p2], 10) is p2
    with pytest.raises(ValueError, match="known: cache-aware, least-loaded, round-robin"):
        make_policy("random")


def test_a_request_that_ended_since_the_report_is_not_counted_running():
    """A node's report lags a request's end by up to a heartbeat: the router saw it end (its
    stream), so an idle node whose last report still shows it running ties with another idle node
    (the first id wins), and is not passed over for the node that ran a request after it."""
    from router.policy import make_policy
    from router.registry import NodeEntry

    pol = make_policy("least-loaded")
    d0 = NodeEntry(_info("d0", "x:1", free_slots=7, free_blocks=90, running=1))  # reported mid-request
    d1 = NodeEntry(_info("d1", "x:2", free_slots=8, free_blocks=90))
    d0.credit(1, 0, 0)  # ... which ended since (RouterService.done)
    assert d0.est_running() == 0 and pol.choose_decode([d0, d1], 10) is d0
    d0.inflight = 1  # one of the router's own is placed there now
    assert d0.est_running() == 1 and pol.choose_decode([d0, d1], 10) is d1


def test_an_end_stays_credited_until_a_report_counts_it():
    """A report the node built before a request ended (NodeInfo.requests_ended below the end's node_ended)
    still shows that request's slot and pages in use: the router keeps its credit (the node is not
    taken for busier than it is) and drops it with the first report that counts the end; an end of
    unknown order (node_ended 0) goes with the next report, as before."""
    from router.registry import NodeEntry

    e = NodeEntry(_info("d0", "x:1", free_slots=7, free_blocks=90, running=1))
    e.info.requests_ended = 4
    e.credit(1, 10, 5)  # it ended as the node's 5th end
    assert (e.est_free_slots(), e.est_free_blocks(), e.est_running()) == (8, 100, 0)
    e.reported()  # a report built before the end: 4 ended, the request still in it
    assert (e.est_free_slots(), e.est_free_blocks(), e.est_running()) == (8, 100, 0)
    e.info.capacity.CopyFrom(pb.Capacity(total_blocks=100, free_blocks=100, block_size=16, total_slots=8, free_slots=8))
    e.info.requests_ended = 5
    e.reported()  # the one after: it counts the end, and the credit goes
    assert (e.freed_slots, e.freed_blocks, e.credits) == (0, 0, [])
    assert (e.est_free_slots(), e.est_free_blocks(), e.est_running()) == (8, 100, 0)
    e.credit(1, 10, 0)  # order unknown: credited until the next report
    assert e.est_free_slots() == 8 and e.freed_slots == 1
    e.reported()
    assert e.freed_slots == 0


class _FakeDecode(rpc.DecodeNodeServicer):
    def __init__(self):
        self.address = ""

    def Stats(self, request, context):
        return _info("static-0", self.address)


def test_static_node_is_polled():
    from router.server import RouterConfig, serve

    fake = _FakeDecode()
    srv, port, _ = start_server("127.0.0.1:0", lambda s: rpc.add_DecodeNodeServicer_to_server(fake, s), ["DecodeNode"])
    fake.address = f"127.0.0.1:{port}"
    r, rport = serve(
        "127.0.0.1:0",
        RouterConfig(
            static_decode=(fake.address,), heartbeat_interval_s=0.1, dead_after_s=0.5, admission_timeout_s=0.3
        ),
    )
    try:
        with channel(f"127.0.0.1:{rport}") as ch:
            stub = rpc.RegistryStub(ch)
            wait_for(lambda: _alive(stub) == {"static-0": True}, 5, "the static node polled")
            assert stub.ListNodes(pb.ListNodesRequest(), timeout=5).nodes[0].static
            srv.stop(0).wait()
            wait_for(lambda: _alive(stub) == {"static-0": False}, 5, "the static node marked dead")
            # no live decode node: UNAVAILABLE after the admission wait
            from client import Client, PdserveError

            with Client(f"127.0.0.1:{rport}") as c, pytest.raises(PdserveError) as ei:
                c.generate(prompt_token_ids=[1], max_tokens=1)
            import grpc

            assert ei.value.code == grpc.StatusCode.UNAVAILABLE
            assert ei.value.message == (
                "no decode node is ready: start one or wait (none took new requests within this request's 0.3 s "
                "admission budget)"
            ), ei.value
    finally:
        r.stop(0)
        srv.stop(0)


def test_pools_file(tmp_path, ckpt):
    from router.cli import _up_spec, build_parser

    cfg = tmp_path / "pools.yaml"
    cfg.write_text(
        f"model: {ckpt}\nport: 0\nprefill: {{count: 2, tp: 2}}\n"
        "decode: {count: 3, tp: 1, local_prefill_threshold: 64}\n"
    )
    spec = _up_spec(build_parser().parse_args(["up", "--config", str(cfg), "--decode", "1"]))
    assert (spec.prefill, spec.prefill_tp, spec.decode, spec.decode_tp) == (2, 2, 1, 1)  # the command line wins
    assert spec.decode_options["local_prefill_threshold"] == 64 and spec.port == 0
    cfg.write_text("bogus: 1\n")
    with pytest.raises(ValueError, match="unknown key"):
        _up_spec(build_parser().parse_args(["up", "--config", str(cfg)]))


def test_heartbeat_tells_a_decode_node_whether_a_prefill_pool_is_ready(router):
    """HeartbeatResponse.prefill_pool: true for a decode node once a prefill node with its schema
    is ready (its short prompts are then its thresholds' follow-ups, capped per step), false
    before and for the prefill node itself."""
    r, stub = router

    def beat(info):
        return stub.Heartbeat(
            pb.HeartbeatRequest(node_id=info.node_id, incarnation=1, capacity=info.capacity), timeout=5
        )

    d = _info("d0", "127.0.0.1:1")
    d.schema_digest = "x"
    stub.Register(pb.RegisterRequest(node=d), timeout=5)
    assert beat(d).prefill_pool is False  # colocated: every prompt is the decode node's
    p = _info("p0", "127.0.0.1:2", kind=pb.NODE_KIND_PREFILL)
    p.schema_digest, p.prefill_ready = "x", True
    stub.Register(pb.RegisterRequest(node=p), timeout=5)
    assert beat(d).prefill_pool is True
    assert beat(p).prefill_pool is False


def test_queued_prompt_tokens_count_each_prompt_once_across_reports():
    """The router's estimate of a node's queued prompt tokens against a simulated node that
    queues what it is sent and reports its queue now and then: prompts in flight when a report
    comes are in the report, and must not count again as in flight (a burst's reports otherwise
    doubled a node's queue and turned its conversations away from their caches)."""
    import random

    from router.registry import NodeEntry

    e = NodeEntry(info=_info("d0", "127.0.0.1:1"))
    rng = random.Random(0)
    node: list[int] = []  # the node's queue, first in first out
    for _ in range(2000):
        op = rng.random()
        if op < 0.4:  # the router sends a prompt
            n = rng.randrange(1, 200)
            node.append(n)
            e.prefill_sent(n)
        elif op < 0.75 and node:  # the node computes the oldest one: its first token is back
            e.prefill_back(node.pop(0))
        elif op >= 0.75:  # the node reports its queue
            e.info.capacity.queued_prefill_tokens = sum(node)
            e.reported()
        assert e.queued_prefill_tokens() == sum(node)


def test_a_second_live_node_under_one_id_is_refused(router):
    """Two processes under one node id (two nodes started without --node-id): the second's Register
    is refused ALREADY_EXISTS naming the holder, which stays registered (they replaced each other
    twice a second, breaking the transfers); the same id at the same address is a restart and is
    taken back at once; once the holder is dead the id is free."""
    import grpc

    _, stub = router
    stub.Register(pb.RegisterRequest(node=_info("d0", "127.0.0.1:1", inc=1)), timeout=5)
    with pytest.raises(grpc.RpcError) as ei:
        stub.Register(pb.RegisterRequest(node=_info("d0", "127.0.0.1:2", inc=2)), timeout=5)
    assert ei.value.code() == grpc.StatusCode.ALREADY_EXISTS and "127.0.0.1:1" in ei.value.details()
    assert stub.Heartbeat(pb.HeartbeatRequest(node_id="d0", incarnation=1, capacity=pb.Capacity()), timeout=5).known
    stub.Register(pb.RegisterRequest(node=_info("d0", "127.0.0.1:1", inc=3)), timeout=5)  # restarted in place
    assert stub.Heartbeat(pb.HeartbeatRequest(node_id="d0", incarnation=3, capacity=pb.Capacity()), timeout=5).known
    wait_for(lambda: _alive(stub) == {"d0": False}, 5, "d0 marked dead")
    stub.Register(pb.RegisterRequest(node=_info("d0", "127.0.0.1:2", inc=4)), timeout=5)  # on a new address
    assert _alive(stub) == {"d0": True}

"""Clients that go away at awkward moments leave no capacity behind: a router, a prefill node and a
decode node in this process (real gRPC servers on loopback, real NIXL agents), every prompt through
the transfer. After each cancel the decode node's pages, slots and reservations, the prefill node's,
and the router's counters (requests in flight, the decode node's in-flight requests and blocks, the
prefill node's in-flight prompt tokens) are back to idle within a second or two, not a lease later,
and the cluster still gives transformers' greedy tokens."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from proto import pb, rpc
from tests.helpers import hybrid_ckpt as hc
from tests.helpers.serve_harness import wait_for


@pytest.fixture(scope="module")
def trio(ckpt):
    from decode_node.config import DecodeNodeConfig
    from decode_node.server import serve as serve_decode
    from prefill_node.config import PrefillNodeConfig
    from prefill_node.server import serve as serve_prefill
    from router.server import RouterConfig, serve

    r, port = serve("127.0.0.1:0", RouterConfig(model=str(ckpt), heartbeat_interval_s=0.2))
    addr = f"127.0.0.1:{port}"
    common = dict(model=str(ckpt), dtype="float32", router=addr, heartbeat_interval_s=0.2)
    p, _ = serve_prefill("127.0.0.1:0", PrefillNodeConfig(**common))
    d, _ = serve_decode("127.0.0.1:0", DecodeNodeConfig(**common, local_prefill_threshold=0))
    try:
        wait_for(
            lambda: (
                r.registry.live(pb.NODE_KIND_DECODE)
                and any(e.info.prefill_ready for e in r.registry.live(pb.NODE_KIND_PREFILL))
            ),
            60,
            "both nodes registered",
        )
        yield r, addr, p, d
    finally:
        d.stop(0)
        p.stop(0)
        r.stop(0)


def _held(r, p, d) -> dict[str, int]:
    """Everything a request holds anywhere in the cluster, by name (all 0 when idle)."""
    out: dict[str, int] = {}
    for name, node in (("decode", d), ("prefill", p)):
        s = node.loop.snapshot
        out |= {
            f"{name} pages": s.total_blocks - s.free_blocks,
            f"{name} slots": s.total_slots - s.free_slots,
            f"{name} reserved": s.reserved,
            f"{name} requests": s.running + s.waiting + s.streaming,
        }
    out["router requests"] = r.service.active
    for e in r.registry.live(pb.NODE_KIND_DECODE):
        out |= {"router decode in flight": e.inflight, "router decode blocks": e.inflight_blocks}
    for e in r.registry.live(pb.NODE_KIND_PREFILL):
        out["router prefill tokens"] = e.inflight_prefill_tokens
    return out


def _idle_within(trio, seconds: float, what: str) -> None:
    r, _, p, d = trio
    try:
        wait_for(lambda: not any(_held(r, p, d).values()), seconds, what)
    except AssertionError:
        raise AssertionError(f"{what}: still held after {seconds} s: {_held(r, p, d)}") from None


def _still_correct(addr: str, ckpt) -> None:
    prompt = hc.prompts(lens=(37,), seed=21)[0]
    with grpc.insecure_channel(addr) as ch:
        sp = pb.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        ms = list(rpc.GenerationStub(ch).Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=sp)))
    assert [t for m in ms for t in m.token_ids] == hc.hf_greedy(ckpt, prompt, 6)
    assert ms[0].prefill_node  # through the transfer


def _cancel_while_reserving(addr: str, reserving: threading.Event, made: list, prompt: list[int]) -> None:
    """A request cancelled once the decode node got its Reserve; returns once the reservation is made."""
    with grpc.insecure_channel(addr) as ch:
        call = rpc.GenerationStub(ch).Generate(
            pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(max_tokens=8))
        )
        assert reserving.wait(10), "the decode node got no Reserve"
        call.cancel()
        with pytest.raises(grpc.RpcError) as ei:
            list(call)
        assert ei.value.code() == grpc.StatusCode.CANCELLED
    wait_for(lambda: made and made[-1].done(), 10, "the reservation made")
    assert made[-1].exception() is None


def test_a_client_gone_while_the_decode_node_reserves_leaves_no_reservation(trio, ckpt, monkeypatch):
    """The client goes away while the decode node makes the reservation: the router's call is
    cancelled before the target comes back. The reservation (pages for the prompt and a GDN slot)
    was held for its whole lease (15 s), with the router counting none of it; now it is released
    at once: by the router, and by the decode node itself when it sees its caller gone."""
    from router.config import RouterConfig

    r, addr, p, d = trio
    assert RouterConfig().reservation_lease_s >= 15  # what it was held for
    _idle_within(trio, 10, "the cluster idle to begin with")
    reserve = d.loop.reserve
    for loop_busy in (True, False):
        reserving = threading.Event()
        made: list = []  # the reservation's future

        def slow(*a, loop_busy=loop_busy, reserving=reserving, made=made, **kw):
            if loop_busy:  # the decode loop is in a long step: the reservation waits behind it
                d.loop.run(lambda engine: time.sleep(0.6))
            reserving.set()
            if not loop_busy:  # the handler reserves after the router's release came: nothing to release then
                time.sleep(0.6)
            made.append(reserve(*a, **kw))
            return made[-1]

        monkeypatch.setattr(d.loop, "reserve", slow)
        _cancel_while_reserving(addr, reserving, made, hc.prompts(lens=(60,), seed=22 + loop_busy)[0])
        _idle_within(trio, 3, "a cancel while the decode loop was busy" if loop_busy else "a cancel before it reserved")
    monkeypatch.undo()
    _still_correct(addr, ckpt)

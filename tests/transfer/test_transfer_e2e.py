"""Real endpoints in separate processes over loopback: source ranks (TP=a) filled from a random
global state through the shard map; destination ranks (TP=b) must hold, bit for bit, the same
global state re-sharded. Plus abort, a killed source, stale notifications and refused writes."""

from __future__ import annotations

import pytest

from tests.helpers.xfer_harness import Cluster

pytestmark = pytest.mark.timeout(180)

TOKENS = 21  # 6 blocks of 4, the last one partly filled


def _transfer_and_check(c: Cluster, rids=("r1", "r2")):
    targets = {}
    for i, rid in enumerate(rids):
        c.fill(rid, seed=7 + i, tokens=TOKENS + i)
        targets[rid] = c.reserve(rid, TOKENS + i)
    for rid in rids:  # both requests in flight at once
        c.send(rid, targets[rid], TOKENS + rids.index(rid))
    for rid in rids:
        assert c.wait(c.dst, rid) == [("done", None)] * len(c.dst)
        assert c.wait(c.src, rid) == [("done", None)] * len(c.src)
    for p in c.dst:
        bad = p.call("check", [(rid, 7 + i, TOKENS + i) for i, rid in enumerate(rids)])[0]
        assert bad == [], f"{p.agent}: {bad}"
        for rid in rids:
            p.call("release", rid)
    c.assert_counts_initial()


PAIRS = (
    [
        pytest.param("nixl", 1, 1, 2, id="nixl-1to1-kvh2"),
        pytest.param("nixl", 2, 1, 1, id="nixl-2to1-kvh1"),
        pytest.param("nixl", 1, 2, 2, id="nixl-1to2-kvh2"),
        pytest.param("nixl", 2, 2, 1, id="nixl-2to2-kvh1"),
        pytest.param("ucxx", 2, 1, 2, id="ucxx-2to1-kvh2"),
        pytest.param("ucxx", 1, 2, 1, id="ucxx-1to2-kvh1"),
    ]
    + [
        pytest.param("nixl", a, b, kvh, id=f"nixl-{a}to{b}-kvh{kvh}", marks=pytest.mark.slow)
        for a, b, kvh in ((4, 1, 2), (1, 4, 2), (4, 2, 1), (2, 4, 4), (4, 4, 2))
    ]
    + [pytest.param("ucxx", 4, 2, 2, id="ucxx-4to2-kvh2", marks=pytest.mark.slow)]
)


@pytest.mark.parametrize("backend,a,b,kvh", PAIRS)
def test_bit_exact_after_transfer(hosts, backend, a, b, kvh):
    with Cluster(hosts, backend, a, b, dict(hk=4, hv=8, kvh=kvh)) as c:
        _transfer_and_check(c)


@pytest.mark.parametrize("backend", ["nixl", "ucxx"])
def test_receiver_abort_during_transfer(hosts, backend):
    with Cluster(hosts, backend, 2, 1) as c:
        c.fill("r", 1, TOKENS)
        target = c.reserve("r", TOKENS)
        c.send("r", target, TOKENS, mode="partial")  # KV written, GDN state and Done not yet
        c.wait(c.src + c.dst, "r", "transferring")
        c.dst[0].call("abort", "r", "client cancelled")
        [(state, err)] = c.wait(c.dst, "r")
        assert state == "failed" and "client cancelled" in err
        for state, err in c.wait(c.src, "r"):
            assert state == "failed" and "released the reservation: client cancelled" in err
        c.assert_counts_initial()


def test_sender_abort_during_transfer(hosts):
    with Cluster(hosts, "nixl", 1, 2) as c:
        c.fill("r", 1, TOKENS)
        target = c.reserve("r", TOKENS)
        c.send("r", target, TOKENS, mode="partial")
        c.wait(c.src + c.dst, "r", "transferring")
        c.src[0].call("abort", "r", "prefill preempted")
        assert c.wait(c.src, "r") == [("failed", "prefill preempted")]
        for state, err in c.wait(c.dst, "r"):
            assert state == "failed" and "source rank 0 aborted: prefill preempted" in err
        c.assert_counts_initial()


def test_source_killed_during_transfer(hosts):
    """The lease expires while a dead source may still write: the memory stays held until the
    router declares the source dead (remove_peer), then everything is freed on both sides."""
    with Cluster(hosts, "nixl", 2, 1, lease_s=3.0) as c:
        c.fill("r", 1, TOKENS)
        target = c.reserve("r", TOKENS, lease_s=3.0)
        c.send("r", target, TOKENS, mode="partial")
        c.wait(c.src + c.dst, "r", "transferring")
        dead = c.src[0]
        dead.proc.kill()
        dead.proc.join(10)
        d = c.dst[0]
        assert d.call("wait", "r", 10.0, "terminal", timeout=30)[1:] == (
            "failed",
            "lease expired (transfer incomplete)",
        )
        assert d.call("counts")[0] != tuple(d.free0), "freed while the dead source could still write"
        # the live source answered the Release; it is quiet and its memory is back
        [(state, err)] = c.wait(c.src[1:], "r")
        assert state == "failed" and "lease expired" in err
        d.call("remove_peer", dead.agent, "declared dead by the router")
        assert c.wait(c.dst, "r") == [("failed", "lease expired (transfer incomplete)")]
        c.assert_counts_initial()


@pytest.mark.parametrize("backend", ["nixl", "ucxx"])
def test_source_killed_then_removed(hosts, backend):
    with Cluster(hosts, backend, 1, 2) as c:
        c.fill("r", 1, TOKENS)
        target = c.reserve("r", TOKENS)
        c.send("r", target, TOKENS, mode="partial")
        c.wait(c.src + c.dst, "r", "transferring")
        c.src[0].proc.kill()
        c.src[0].proc.join(10)
        for p in c.dst:
            p.call("remove_peer", c.src[0].agent, "declared dead by the router")
        for state, err in c.wait(c.dst, "r", timeout=10):
            assert state == "failed" and f"source agent {c.src[0].agent} removed (declared dead by the router)" in err
        c.assert_counts_initial()


def test_stale_notification_never_completes_a_newer_reservation(hosts):
    with Cluster(hosts, "nixl", 1, 1) as c:
        src, dst = c.src[0], c.dst[0]
        c.fill("r", 3, TOKENS)
        old = c.reserve("r", TOKENS)
        old_inc = dst.call("incarnation", "r")[0]
        dst.call("abort", "r", "superseded")
        new = c.reserve("r", TOKENS)  # same request id, new incarnation, likely the same blocks
        src.call("inject_done", dst.agent, "r", old_inc, 0)  # late Done of the old reservation
        new_inc = dst.call("incarnation", "r")[0]
        src.call("inject_done", dst.agent, "r", new_inc, 0)  # Done from a source never granted
        assert dst.call("wait", "r", 1.0, "terminal")[1:] == ("pending", None)
        stale = dst.call("stale")[0]
        assert any(f"r/{old_inc}" in s and "superseded" in s for s in stale), stale
        assert any(f"r/{new_inc}" in s for s in stale), stale
        # a Begin for the old, released reservation is refused and writes nothing
        c.send("r", old, TOKENS)
        [(state, err)] = c.wait(c.src, "r")
        assert state == "failed" and "refused" in err and "released (superseded)" in err, err
        assert dst.call("check", [])[0] == []  # untouched
        # the new reservation still completes, bit-exact
        c.fill("r", 4, TOKENS)
        c.send("r", new, TOKENS)
        assert c.wait(c.dst, "r") == [("done", None)]
        assert dst.call("check", [("r", 4, TOKENS)])[0] == []
        dst.call("release", "r")
        c.assert_counts_initial()

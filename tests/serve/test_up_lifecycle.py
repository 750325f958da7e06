"""`pdserve up` process lifecycle with a TP=1 prefill and a TP=2 decode node: greedy tokens through the
transfer equal transformers',

a full node answers RESOURCE_EXHAUSTED at arrival (no room within its budget), a killed node is marked
dead by the router (with no prefill node left, the decode node prefills), and SIGTERM stops every
child (TP worker processes included) with no orphans."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from tests.helpers.serve_harness import (
    NEW,
    Up,
    alive,
    descendants,
    flags,
    log_url,
    node_info,
    node_pid,
    nodes,
    scrape,
    wait_for,
)


def test_tp2_tokens_admission_node_death_and_no_orphans(ckpt, refs):
    from client import Client, PdserveError

    up = Up(
        "--model",
        ckpt,
        *flags(
            dtype="float32", decode=1, decode_tp=2, prefill=1, max_num_seqs=1, admission_timeout=0.5, metrics_port=0
        ),
    )
    try:
        procs = descendants(up.proc.pid)
        # router, prefill, decode, and the decode node's 2 TP workers (plus spawn helpers)
        assert len(procs) >= 5, procs
        assert {n.node.node_id for n in nodes(up.address) if n.alive} == {"decode-0", "prefill-0"}
        with Client(up.address, timeout=60) as c:
            c.wait_ready(timeout=30)
            ps, want = refs  # a TP=2 decode node gives transformers' tokens too (one at a time: 1 slot)
            for p, w in zip(ps, want, strict=True):
                r = c.generate(prompt_token_ids=p, max_tokens=NEW, temperature=0.0, ignore_eos=True)
                assert r.token_ids == w, f"prompt of {len(p)} tokens"
                assert r.prefill_node == "prefill-0" and r.transfer_bytes > 0
            s = c.stream(prompt_token_ids=[1, 2, 3], max_tokens=4000, temperature=0.0, ignore_eos=True)
            it = iter(s)
            next(it)  # holds the only state slot
            t0 = time.monotonic()
            with pytest.raises(PdserveError) as ei:
                c.generate(prompt_token_ids=[4, 5], max_tokens=4)
            assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "no decode node had room" in ei.value.message
            assert time.monotonic() - t0 < 2 and ei.value.retry_after_s > 0.5  # at arrival: the slot frees in seconds
            s.close()
            # the slot comes back: the cancel reaches the router and the decode node after close()
            # returns, and the router admits by its own count and the node's last report
            held = ("pdserve_router_node_inflight_requests", (("kind", "decode"), ("node", "decode-0")))
            router = log_url(up, r"router metrics at (http://\S+/metrics)")
            wait_for(
                lambda: _slot_free(up.address) and scrape(router)[held] == 0, 30, "the router to see the slot free"
            )
            # and the next request is admitted
            r = c.generate(prompt_token_ids=[4, 5], max_tokens=3, temperature=0.0, ignore_eos=True)
            assert len(r.token_ids) == 3
        procs |= descendants(up.proc.pid)
        # a node that dies is marked dead by the router (missed heartbeats); `up` reports it and goes on
        os.kill(node_pid(up, "prefill-0"), signal.SIGKILL)
        wait_for(
            lambda: {n.node.node_id: n.alive for n in nodes(up.address)} == {"decode-0": True, "prefill-0": False},
            15,
            "the router to mark prefill-0 dead",
        )
        wait_for(lambda: "prefill-0 exited with status -9 (SIGKILL)" in up.output(), 10, "the exit and its signal")
        assert up.proc.poll() is None
        with Client(up.address, timeout=60) as c:  # no prefill node left: the decode node prefills
            r = c.generate(prompt_token_ids=ps[2], max_tokens=NEW, temperature=0.0, ignore_eos=True)
            assert r.token_ids == want[2] and r.prefill_node == ""
        # a TP worker of the decode node dies: the node can step no more, so it stops with status 1
        # (its supervisor restarts it), rather than stay up failing every request
        decode = node_pid(up, "decode-0")
        ranks = _ranks(decode)
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGKILL)
        wait_for(lambda: not alive(decode), 15, "the decode node to stop after losing a TP worker")
        wait_for(lambda: "decode-0 exited with status 1" in up.output(), 10, "`up` to report the exit")
        assert "stopping with status 1 so it is restarted" in up.output()
        wait_for(lambda: not any(n.alive for n in nodes(up.address)), 15, "the router to mark decode-0 dead")
    finally:
        rc = up.stop()
    assert rc == 0, up.output()
    wait_for(lambda: not [p for p in procs if alive(p)], 30, "every child of `pdserve up` to exit")
    assert "pdserve up: stopping" in up.output()


def _slot_free(address: str) -> bool:
    """The decode node's last report to the router shows its one state slot free."""
    cap = node_info(address, "decode-0").capacity
    return cap.free_slots == cap.total_slots >= 1


def _ranks(node: int) -> list[int]:
    """A node's TP worker processes: the children of its fork server (engine/executor.py)."""
    from tests.helpers.serve_harness import _children

    kids = _children()
    server = [p for p in kids.get(node, []) if b"forkserver" in open(f"/proc/{p}/cmdline", "rb").read()]
    assert len(server) == 1, server
    return sorted(kids.get(server[0], []))

"""Overload through `pdserve up` with a short reservation lease (docs/ARCHITECTURE.md, "Leases and
admission"): a burst with more prefill work than one lease covers completes with transformers'
greedy tokens because the prefill node renews the reservations it works on; with a prefill
window and a queue limit the rest waits in the router holding no decode memory, or is refused
RESOURCE_EXHAUSTED (HTTP 429 + Retry-After) before any work; a prefill node killed mid-queue
frees the decode reservations within the lease. No lease expires where a peer is alive, and
every page and slot is free afterwards."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.helpers import hybrid_ckpt as hc
from tests.helpers.serve_harness import (
    Up,
    decode_stats,
    flags,
    log_url,
    node_info,
    node_pid,
    prefill_stats,
    scrape,
    wait_for,
)

LEASE = 2.0  # seconds; the prefill node renews every third of it, between engine steps
# how late after a lease a loaded 2-core runner may free it (the decode node's tick, the stats call)
LEASE_SLACK = 3.0
# the burst test's lease: well under the burst's prefill time (its last request waited 1.7 s on
# the loaded 2-core machine with the float32 C paths), so renewals happen on a fast one too
BURST_LEASE = 0.75
STEP = ("--max-num-batched-tokens", "128")  # prefill steps well inside a lease on a slow machine
PROMPT_LEN, NEW = 300, 8
QUEUED_S = 0.5  # how long the cancelled stream waits in the queue before it leaves


@pytest.fixture(scope="module")
def burst(ckpt):
    """Three distinct prompts and transformers' greedy tokens after each."""
    ps = hc.prompts(lens=(PROMPT_LEN, PROMPT_LEN + 7, PROMPT_LEN - 9), seed=21)
    return ps, [hc.hf_greedy(ckpt, p, NEW) for p in ps]


def _unwindowed(ckpt, lease: float = LEASE, *extra: str) -> Up:
    """1 prefill + 1 decode node, a short lease, no prefill window: every request reserves at
    once, so reservations wait on the prefill node's queue for longer than a lease."""
    return Up(
        "--model",
        ckpt,
        *flags(
            dtype="float32",
            prefill=1,
            decode=1,
            metrics_port=0,
            reservation_lease=lease,
            prefill_window_tokens=0,
            admission_timeout=300,
            # these tests time leases to the second: a decode node at `up`'s shared-CPU nice value
            # (7) is starved by the other test worker's processes at nice 0 on a 2-core runner
            decode_nice=0,
        ),
        *STEP,
        *extra,
    )


def _run(c, p):
    from client import PdserveError

    try:
        return c.generate(prompt_token_ids=p, max_tokens=NEW, temperature=0.0, ignore_eos=True)
    except PdserveError as e:
        return e


class _MaxReserved:
    """Samples the decode node's open reservations (Stats) in a thread; `peak` is the most seen."""

    def __init__(self, address: str):
        self.address, self.peak, self._stop = address, 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, decode_stats(self.address).capacity.reserved)

    def stop(self) -> int:
        self._stop.set()
        self._t.join(10)
        return self.peak


def _no_expiry_all_free(up: Up, decode_metrics: dict, initial) -> None:
    """No lease expired (metric and logs); every page and slot is free on both nodes."""
    assert decode_metrics[("pdserve_decode_lease_expiries_total", ())] == 0
    assert "lease expired" not in up.output()
    d, p = node_info(up.address, "decode-0"), node_info(up.address, "prefill-0")
    wait_for(lambda: decode_stats(d.address).capacity == initial, 20, "the decode node's pages and slots back")
    c = prefill_stats(p.address).capacity
    assert (c.free_blocks, c.free_slots, c.running, c.waiting) == (c.total_blocks, c.total_slots, 0, 0)


def test_burst_longer_than_a_lease_completes_with_renewed_leases(ckpt, burst):
    """No prefill window: every request reserves at once, so most reservations wait on the prefill
    node's queue far longer than a lease. The prefill node renews them; all complete exactly."""
    from client import Client

    ps, want = burst
    # no prefix cache: the burst repeats 3 prompts, and with the cache (and requests in flight
    # sharing a prefix) the prefill node computes each once, finishing inside a lease
    up = _unwindowed(ckpt, BURST_LEASE, "--no-prefix-caching")
    try:
        d = node_info(up.address, "decode-0")
        initial = decode_stats(d.address).capacity
        durl = log_url(up, r"decode node decode-0 metrics at (http://\S+/metrics)")
        n = 60  # 18k prompt tokens: several leases of prefill on any machine this runs on
        with Client(up.address, timeout=300) as c:
            c.wait_ready(timeout=60)
            peak = _MaxReserved(d.address)
            with ThreadPoolExecutor(n) as ex:
                outs = list(ex.map(lambda i: _run(c, ps[i % 3]), range(n)))
            peak = peak.stop()
        for i, r in enumerate(outs):
            assert not isinstance(r, Exception), (i, r)
            assert r.token_ids == want[i % 3] and r.prefill_node == "prefill-0", i
        assert max(r.ttft_s for r in outs) > BURST_LEASE, "the burst must outlast a lease to test renewals"
        assert peak > n // 2, f"most requests should hold a reservation while queued (peak {peak})"
        m = scrape(durl)
        assert m[("pdserve_decode_lease_renewals_total", ())] >= n
        _no_expiry_all_free(up, m, initial)
    finally:
        rc = up.stop()
    assert rc == 0, up.output()


def test_overload_waits_unreserved_in_the_router_or_is_refused_before_work(ckpt, burst):
    """A window of two prompts per prefill node and a queue of four: a burst of 20 reserves at most
    a few pages at a time; each request completes exactly or is refused RESOURCE_EXHAUSTED (at once
    when the queue is full, or after the admission timeout) having reached no node; HTTP says 429
    with Retry-After."""
    from client import Client

    ps, want = burst
    window, queue = 2 * PROMPT_LEN + 20, 4
    up = Up(
        "--model",
        ckpt,
        *flags(
            dtype="float32",
            prefill=1,
            decode=1,
            metrics_port=0,
            http_port=0,
            reservation_lease=LEASE,
            prefill_window_tokens=window,
            max_queued_requests=queue,
            admission_timeout=6,
        ),
        *STEP,
        # the burst repeats 3 prompts: with the prefix cache the router counts a repeat at the few
        # tokens the node still computes of it, and the window would take the whole burst
        "--no-prefix-caching",
        # prefill throttled (1 ms a prompt token): the queue stays full long enough to be seen, on
        # a machine fast enough to clear a 20-request burst in a fifth of a second otherwise
        env={"PDSERVE_TEST_PREFILL_DELAY_PER_TOKEN_S": "0.001"},
    )
    try:
        d = node_info(up.address, "decode-0")
        initial = decode_stats(d.address).capacity
        urls = {
            k: log_url(up, rf"{k} metrics at (http://\S+/metrics)")
            for k in ("router", "decode node decode-0", "prefill node prefill-0")
        }
        base = log_url(up, r"OpenAI-compatible HTTP on (http://\S+/v1)")
        n = 20
        with Client(up.address, timeout=300) as c:
            c.wait_ready(timeout=60)
            peak = _MaxReserved(d.address)
            with ThreadPoolExecutor(n) as ex:
                futs = [ex.submit(_run, c, ps[i % 3]) for i in range(n)]
                wait_for(
                    lambda: scrape(urls["router"])[("pdserve_router_queue_depth", ())] == queue,
                    30,
                    "a full admission queue",
                )
                body = json.dumps({"model": "ckpt", "prompt": [1, 2, 3], "max_tokens": 2}).encode()
                req = urllib.request.Request(base + "/completions", body, {"Content-Type": "application/json"})
                with pytest.raises(urllib.error.HTTPError) as ei:
                    urllib.request.urlopen(req, timeout=60)
                assert ei.value.code == 429 and ei.value.headers["Retry-After"], ei.value.read()
                outs = [f.result(timeout=300) for f in futs]
            peak = peak.stop()
        done = [(i, r) for i, r in enumerate(outs) if not isinstance(r, Exception)]
        refused = [(i, r) for i, r in enumerate(outs) if isinstance(r, Exception)]
        for i, r in done:
            assert r.token_ids == want[i % 3] and r.prefill_node == "prefill-0", i
        for i, e in refused:
            assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED, (i, e.code, e.message)
        assert done and refused, outs
        assert peak <= 3, f"{peak} reservations at once: the window allows two prompts (+ one pushing)"
        r, p, dm = (scrape(urls[k]) for k in ("router", "prefill node prefill-0", "decode node decode-0"))
        refused_total = sum(
            r[("pdserve_router_admission_refused_total", (("class", c), ("reason", k)))]
            for k in ("queue_full", "estimate")
            for c in ("interactive", "batch")
        )
        assert refused_total >= len(refused) + 1  # the burst's and the HTTP request
        assert r[("pdserve_router_queue_wait_seconds_count", ())] >= len(done)
        # refused requests never reached a node: the prefill node computed only what completed
        assert p[("pdserve_prefill_requests_total", (("outcome", "error"),))] == 0
        _no_expiry_all_free(up, dm, initial)
    finally:
        rc = up.stop()
    assert rc == 0, up.output()


def test_client_that_leaves_the_queue_is_gone_from_it_at_once(ckpt, burst):
    """The only prefill node is frozen (SIGSTOP), so the window holds two prompts and the rest wait
    in the router's queue for as long as the test needs; a queued stream that is cancelled leaves
    the queue at once, and once the node resumes every other request completes exactly. The lease
    is long here: this test is about the router's queue, not about expiring reservations."""
    from client import Client

    ps, want = burst
    window = 2 * PROMPT_LEN + 20
    up = Up(
        "--model",
        ckpt,
        *flags(
            dtype="float32",
            prefill=1,
            decode=1,
            metrics_port=0,
            reservation_lease=60,
            prefill_window_tokens=window,
            max_queued_requests=4,
            admission_timeout=120,
        ),
        *STEP,
        "--no-prefix-caching",  # the same prompt 5 times: cached, the window would take them all
    )
    try:
        d = node_info(up.address, "decode-0")
        initial = decode_stats(d.address).capacity
        rurl = log_url(up, r"router metrics at (http://\S+/metrics)")

        def depth() -> float:
            return scrape(rurl)[("pdserve_router_queue_depth", ())]

        victim = node_pid(up, "prefill-0")
        with Client(up.address, timeout=300) as c:
            c.wait_ready(timeout=60)
            os.kill(victim, signal.SIGSTOP)
            try:
                with ThreadPoolExecutor(5) as ex:
                    futs = [ex.submit(_run, c, ps[0]) for _ in range(5)]  # two in the window, three queued
                    wait_for(lambda: depth() == 3, 30, "three requests queued")
                    s = c.stream(
                        prompt_token_ids=ps[1], max_tokens=NEW, temperature=0.0, ignore_eos=True, request_id="left"
                    )
                    wait_for(lambda: depth() == 4, 30, "the stream queued")
                    time.sleep(QUEUED_S)
                    t = time.monotonic()
                    s.cancel()
                    wait_for(lambda: depth() == 3, 5, "the cancelled request out of the queue")
                    assert time.monotonic() - t < 2.0
                    os.kill(victim, signal.SIGCONT)
                    outs = [f.result(timeout=300) for f in futs]
            finally:
                os.kill(victim, signal.SIGCONT)
        for i, r in enumerate(outs):
            assert not isinstance(r, Exception), (i, r)
            assert r.token_ids == want[0] and r.prefill_node == "prefill-0", i
        assert depth() == 0
        wait_for(lambda: decode_stats(d.address).capacity == initial, 20, "the decode node's pages and slots back")
        # its INFO line says how long it waited in the queue before it left (not 0 ms)
        line = wait_for(lambda: re.search(r"request left: .*queue ([\d.]+) ms.*", up.output()), 10, "its log line")
        assert float(line.group(1)) >= QUEUED_S * 1e3 and "cancelled" in line.group(0), line.group(0)
    finally:
        rc = up.stop()
    assert rc == 0, up.output()


def test_prefill_node_killed_mid_queue_frees_reservations_within_the_lease(ckpt, burst):
    """Requests hold reservations while queued on the only prefill node; it is SIGKILLed. The
    decode node's pages and slots are back within a lease, and every request completes with
    transformers' tokens (the decode node prefills what is left)."""
    from client import Client

    ps, want = burst
    up = _unwindowed(ckpt)
    try:
        d = node_info(up.address, "decode-0")
        initial = decode_stats(d.address).capacity
        victim = node_pid(up, "prefill-0")
        n = 12
        with Client(up.address, timeout=300) as c:
            c.wait_ready(timeout=60)
            with ThreadPoolExecutor(n) as ex:
                futs = [ex.submit(_run, c, ps[i % 3]) for i in range(n)]
                wait_for(lambda: decode_stats(d.address).capacity.reserved >= n // 2, 30, "reservations held")
                os.kill(victim, signal.SIGKILL)
                t_kill = time.monotonic()
                wait_for(lambda: decode_stats(d.address).capacity.reserved == 0, LEASE, "reservations freed")
                freed_s = time.monotonic() - t_kill
                outs = [f.result(timeout=300) for f in futs]
        assert freed_s < LEASE
        for i, r in enumerate(outs):
            assert not isinstance(r, Exception), (i, r)
            assert r.token_ids == want[i % 3], (i, r.prefill_node)
        assert any(r.prefill_node == "" for r in outs)  # prefilled on the decode node after the kill
        wait_for(lambda: decode_stats(d.address).capacity == initial, 20, "the decode node's pages and slots back")
    finally:
        rc = up.stop()
    assert rc == 0, up.output()


def test_hung_prefill_node_stops_renewing_and_its_reservations_expire(ckpt, burst):
    """The lease is for a dead or hung peer: the only prefill node is frozen (SIGSTOP) with requests
    queued, so nobody renews their reservations. Those no write was granted for are freed within a
    lease (counted as expiries); once the node is killed, the rest are freed, the decode node
    prefills what is left, and at most the request whose push was cut off fails."""
    from client import Client

    ps, want = burst
    # the router declares the frozen node dead only well after a lease: the leases, not its
    # release of a dead node's reservations, are what must free them
    up = _unwindowed(ckpt, LEASE, "--dead-after", "10")
    try:
        d = node_info(up.address, "decode-0")
        initial = decode_stats(d.address).capacity
        durl = log_url(up, r"decode node decode-0 metrics at (http://\S+/metrics)")
        victim = node_pid(up, "prefill-0")
        p_addr = node_info(up.address, "prefill-0").address
        n = 12
        with Client(up.address, timeout=300) as c:
            c.wait_ready(timeout=60)
            with ThreadPoolExecutor(n) as ex:
                futs = [ex.submit(_run, c, ps[i % 3]) for i in range(n)]
                wait_for(lambda: decode_stats(d.address).capacity.reserved >= n // 2, 30, "reservations held")
                # prompts the prefill node had begun (writes granted for their pages as they go):
                # read just before the freeze, one more may begin in between
                begun = prefill_stats(p_addr).capacity.running
                os.kill(victim, signal.SIGSTOP)
                try:
                    held = decode_stats(d.address).capacity.reserved
                    t_stop = time.monotonic()
                    bound = LEASE + LEASE_SLACK
                    # all but those a write was granted for (the prompts begun, usually the last
                    # step's 2 of 128 tokens) and one whose state was in when the node froze
                    most = max(3, begun + 2)
                    seen: list[int] = []

                    def left() -> bool:
                        seen.append(decode_stats(d.address).capacity.reserved)
                        return seen[-1] <= most

                    try:
                        wait_for(left, bound, "leases expired")
                    except AssertionError as e:  # say what stayed reserved
                        raise AssertionError(
                            f"{e}: reserved {held} at the freeze ({begun} begun), then {seen[:2]} ... {seen[-3:]}"
                        ) from None
                    assert time.monotonic() - t_stop < bound
                    expired = scrape(durl)[("pdserve_decode_lease_expiries_total", ())]
                    assert expired >= held - most, (held, expired)
                    # the log line (its reader runs behind on a loaded box); a source that had begun
                    # its push when the node froze expires as incomplete
                    up.find(r"(lease expired \((?:no source began|transfer incomplete)\))")
                finally:
                    os.kill(victim, signal.SIGKILL)  # what is left is freed, and no call waits on it
                outs = [f.result(timeout=300) for f in futs]
        failed = [(i, r) for i, r in enumerate(outs) if isinstance(r, Exception)]
        assert len(failed) <= 1, failed
        for i, e in failed:  # its state was being pushed when the node froze
            assert e.code in (grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE), (i, e.code, e.message)
        for i, r in enumerate(outs):
            if not isinstance(r, Exception):
                assert r.token_ids == want[i % 3], (i, r.prefill_node)
        wait_for(lambda: decode_stats(d.address).capacity == initial, 20, "the decode node's pages and slots back")
    finally:
        rc = up.stop()
    assert rc == 0, up.output()

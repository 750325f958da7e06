"""Two routers in front of the same pools (`--router A,B` on every node): both route to every node
with transformers' tokens, and when one router stops the other goes on serving, so the router is
not a single point of failure; an SDK client given both routers fails over to the live one, also
while the decode node still holds the dead router's copy of the request under the same id."""

from __future__ import annotations

import asyncio
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

from tests.helpers import hybrid_ckpt as hc
from tests.helpers.serve_harness import NEW, Proc, decode_stats, node_info, two_routers, wait_for


def test_two_routers_share_the_pools(ckpt, refs):
    from client import AsyncClient, Client

    ps, want = refs
    procs: list[Proc] = []
    try:
        ra, rb = two_routers(ckpt, procs)
        with Client(ra.address, timeout=120) as a, Client(rb.address, timeout=120) as b:
            a.wait_ready(60)
            b.wait_ready(60)
            jobs = [(c, i) for i in range(len(ps)) for c in (a, b)]
            with ThreadPoolExecutor(len(jobs)) as ex:
                greedy = dict(max_tokens=NEW, temperature=0.0, ignore_eos=True)
                outs = list(ex.map(lambda j: j[0].generate(prompt_token_ids=ps[j[1]], **greedy), jobs))
            for (_, i), r in zip(jobs, outs, strict=True):
                assert r.token_ids == want[i] and r.prefill_node == "prefill-0", f"prompt of {len(ps[i])} tokens"
            ra.proc.send_signal(signal.SIGTERM)
            assert ra.proc.wait(60) == 0, ra.output()
            for i in range(len(ps)):  # the other router serves alone
                r = b.generate(prompt_token_ids=ps[i], max_tokens=NEW, temperature=0.0, ignore_eos=True)
                assert r.token_ids == want[i] and r.prefill_node == "prefill-0"
        # an SDK given both routers fails over to the live one (the first is gone: UNAVAILABLE)
        with Client([ra.address, rb.address], timeout=120) as c:
            r = c.generate(prompt_token_ids=ps[2], max_tokens=NEW, temperature=0.0, ignore_eos=True)
            assert r.token_ids == want[2] and c.addr == rb.address

        async def via_async():
            async with AsyncClient(f"{ra.address},{rb.address}", timeout=120) as ac:
                return await ac.generate(prompt_token_ids=ps[3], max_tokens=NEW, temperature=0.0, ignore_eos=True)

        assert asyncio.run(via_async()).token_ids == want[3]
    finally:
        for p in reversed(procs):
            p.stop()
    for p in procs[2:]:
        assert p.proc.returncode == 0, p.output()


def test_the_sdk_resends_while_the_dead_routers_reservation_holds_the_id(ckpt):
    """Router A is SIGKILLed while the prefill node computes a long prompt for it: the decode node
    holds A's reservation under the request's id until its lease runs out when the SDK sends the
    request, same id, to router B. B goes on under an id of its own on the nodes and the answer is
    transformers' tokens (it failed INVALID_ARGUMENT "request id ... is already in flight")."""
    from client import Client

    p, n = hc.prompts(lens=(1500,), seed=71)[0], 8  # long: a second of prefill on the prefill node
    procs: list[Proc] = []
    try:
        ra, rb = two_routers(ckpt, procs)
        d = node_info(rb.address, "decode-0")

        def kill_a_once_reserved() -> None:
            wait_for(lambda: decode_stats(d.address).capacity.reserved == 1, 60, "A's reservation on decode-0")
            ra.proc.send_signal(signal.SIGKILL)

        killer = threading.Thread(target=kill_a_once_reserved)
        with Client([ra.address, rb.address], timeout=120) as c:
            c.wait_ready(60)
            assert c.addr == ra.address
            killer.start()
            r = c.generate(prompt_token_ids=p, max_tokens=n, temperature=0.0, ignore_eos=True, request_id="resent-1")
            assert c.addr == rb.address
        killer.join()
        assert r.token_ids == hc.hf_greedy(ckpt, p, n) and r.request_id == "resent-1"
        rb.find(r"decode-0 holds its id still; placed again as (resent-1~r1)")
    finally:
        for pr in reversed(procs):
            pr.stop()

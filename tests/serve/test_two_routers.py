"""Two routers in front of the same pools (`--router A,B` on every node): both route to every node
with transformers' tokens, and when one router stops the other goes on serving, so the router is
not a single point of failure; an SDK client given both routers fails over to the live one."""

from __future__ import annotations

import asyncio
import signal
from concurrent.futures import ThreadPoolExecutor

from tests.helpers.serve_harness import NEW, Proc, two_routers


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

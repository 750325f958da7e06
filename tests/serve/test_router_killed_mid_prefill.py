"""A router killed (SIGKILL) while a prefill node computes a prompt: the prefill node's Prefill
call is cancelled with the router's channel, and it tells the decode node that nothing will come,
so the decode node's reservation (pages and a GDN state slot) comes back within seconds; it was
held for the reservation's whole lease (15 s), and a draining decode node waited for it too.
Real processes: a router, a prefill node (throttled: PDSERVE_TEST_PREFILL_DELAY_PER_TOKEN_S) and a
decode node."""

from __future__ import annotations

import os
import signal
import threading
import time

from tests.helpers import hybrid_ckpt as hc
from tests.helpers.serve_harness import Proc, decode_stats, flags, node_info, wait_for

DELAY = 0.004  # s per prompt token: the prompt's chunks take 8 s in all
PROMPT = 2000
# one prompt at a time, in chunks of 256 tokens (1 s each): the second prompt waits in the prefill
# node's queue, its decode reservation made and its lease renewed, its push not yet opened
P_FLAGS = flags(max_num_seqs=1, max_num_batched_tokens=256)


def test_a_router_killed_mid_prefill_frees_the_decode_reservation_promptly(ckpt):
    from client import Client
    from router.server import RouterConfig

    procs: list[Proc] = []
    try:
        r = Proc("router", "--port", "0", "--model", ckpt, ready=r"router listening on (\S+)")
        procs.append(r)
        pooled = flags(dtype="float32", router=r.address)
        env = {"PDSERVE_TEST_PREFILL_DELAY_PER_TOKEN_S": str(DELAY)}
        ready = r"prefill node \S+ listening on (\S+)"
        procs.append(Proc("prefill", "--model", ckpt, *pooled, *P_FLAGS, ready=ready, env=env))
        pooled_d = [*pooled, *flags(local_prefill_threshold=0)]  # every prompt through the prefill node
        procs.append(Proc("decode", "--model", ckpt, *pooled_d, ready=r"decode node \S+ listening on (\S+)"))
        wait_for(lambda: node_info(r.address, "decode-0") and node_info(r.address, "prefill-0"), 60, "both registered")
        d = node_info(r.address, "decode-0").address
        idle = decode_stats(d).capacity
        assert RouterConfig().reservation_lease_s >= 15  # what the reservation was held for

        def ask(seed: int):  # ends with an error once the router is gone
            try:
                with Client(r.address, timeout=60) as c:
                    c.generate(prompt_token_ids=hc.prompts(lens=(PROMPT,), seed=seed)[0], max_tokens=4)
            except Exception:  # noqa: BLE001
                pass

        ts = [threading.Thread(target=ask, args=(seed,), daemon=True) for seed in (3, 4)]
        for t in ts:
            t.start()
        wait_for(lambda: decode_stats(d).capacity.reserved == 2, 30, "the decode node's two reservations")
        time.sleep(1.0)  # the prefill node is computing the first prompt's chunks, the second waits
        os.kill(r.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        wait_for(lambda: decode_stats(d).capacity == idle, 20, "the decode node's pages and slot back")
        back = time.monotonic() - t0
        assert back < 5, back  # the cancel's path, not the 15 s lease
        for t in ts:
            t.join(10)
    finally:
        for p in reversed(procs):
            p.stop()

"""A decode node that dies (SIGKILL) while a prefill node still pushes a prompt's state to it:
once the router's heartbeats declare it dead, the router tells every prefill node
(PrefillNode.Abort with dead_decode_node), which drops the node's transfer agents, so the push
ends and the prefill node's memory comes back within seconds, not after the 30 s a write to a
vanished peer otherwise waits; the stream moves to the other decode node and ends with
transformers' tokens."""

from __future__ import annotations

import os
import signal
import time

from tests.helpers import hybrid_ckpt as hc
from tests.helpers.serve_harness import Up, flags, node_pid, nodes, prefill_stats, wait_for


def test_a_push_to_a_decode_node_declared_dead_gives_its_memory_back(ckpt):
    from client import Client
    from proto import pb

    u = Up("--model", ckpt, *flags(dtype="float32", prefill=1, decode=2))
    p, n = hc.prompts(lens=(3000,), seed=61)[0], 24
    try:
        listed = nodes(u.address)
        (pre,) = [d.node.address for d in listed if d.node.kind == pb.NODE_KIND_PREFILL]
        slots = prefill_stats(pre).capacity.total_slots
        with Client(u.address, timeout=120) as c:
            c.wait_ready(60)
            it = iter(c.stream(prompt_token_ids=p, max_tokens=n, temperature=0.0, ignore_eos=True))
            first = next(it)
            victim = first.decode_node
            os.kill(node_pid(u, victim), signal.SIGKILL)  # its push from the prefill node under way
            t0 = time.monotonic()
            wait_for(lambda: prefill_stats(pre).capacity.free_slots == slots, 25, "the prefill node's slot back")
            back = time.monotonic() - t0
            toks = list(first.token_ids) + [t for ch in it for t in ch.token_ids]
        assert toks == hc.hf_greedy(ckpt, p, n)
        assert back < 15, back  # the heartbeats' 3 s and a poll, not the 30 s a write to a dead peer waits
        wait_for(lambda: f"dropped the transfer agents of {victim}" in u.output(), 15, "the prefill node told")
    finally:
        u.stop()

"""Cache-aware routing through `pdserve up` (two decode nodes, one prefill node): a conversation's
next turn goes to the decode node that holds its earlier turns, both right after the turn before
(the router remembers where it sent it) and once only the nodes' prefix digests say so, while an
unrelated prompt goes to the least-loaded node. A turn with many new tokens is prefilled on the
prefill node from its own snapshot; one with few, on the decode node from the state it finished the
turn before with (--local-resume-threshold). Every output is transformers' greedy."""

from __future__ import annotations

import time

import pytest

from tests.helpers import hybrid_ckpt as hc
from tests.helpers.serve_harness import BLOCK, Up, decode_stats, flags, node_info, wait_for

MEMORY_S = 2.0  # --prefix-memory: turn 3 waits past it, routed by the digests alone
BUSY = 200  # tokens of the request that keeps decode-0 busy: still decoding when turn 1 is routed,
# even on a loaded machine (40 were done before turn 1 arrived in one CI run); turn 2 on decode-1
# is as long, to be still decoding when the unrelated prompt is routed (40 were not, in one)


@pytest.fixture(scope="module")
def up(ckpt):
    u = Up("--model", ckpt, *flags(dtype="float32", decode=2, prefill=1, block_size=BLOCK, prefix_memory=MEMORY_S))
    yield u
    rc = u.stop()
    assert rc == 0, u.output()


def test_next_turn_goes_where_the_conversation_is(up, ckpt):
    from client import Client, GenerateResult
    from router.prefix import PrefixQuery

    new = 6
    # user2 is past the decode nodes' default resume threshold (256 new tokens): turn 2 is pooled
    hold, turn1, user2, user3, unrelated = hc.prompts(lens=(20, 3 * BLOCK + 5, 300, 9, 2 * BLOCK + 7), seed=31)
    greedy = dict(temperature=0.0, ignore_eos=True)
    with Client(up.address, timeout=180) as c:
        c.wait_ready(timeout=90)
        # a request decoding on decode-0 (the least-loaded tie goes to the first id): turn 1 goes to decode-1
        busy = iter(c.stream(prompt_token_ids=hold, max_tokens=BUSY, **greedy))
        h = GenerateResult()
        h.add(next(busy))
        assert h.decode_node == "decode-0"
        r1 = c.generate(prompt_token_ids=turn1, max_tokens=new, **greedy)
        assert (r1.decode_node, r1.prefill_node, r1.cached_tokens) == ("decode-1", "prefill-0", 0)
        for ch in busy:
            h.add(ch)
        # both idle now: least-loaded would pick decode-0; the conversation is on decode-1
        turn2 = turn1 + r1.token_ids + user2
        s2 = iter(c.stream(prompt_token_ids=turn2, max_tokens=BUSY, **greedy))
        r2 = GenerateResult()
        r2.add(next(s2))
        assert (r2.decode_node, r2.prefill_node) == ("decode-1", "prefill-0")
        assert r2.cached_tokens == len(turn1)  # the prefill node resumed from turn 1's end-of-prompt snapshot
        # while turn 2 decodes on decode-1, a prompt sharing nothing goes to the least-loaded node
        ru = c.generate(prompt_token_ids=unrelated, max_tokens=new, **greedy)
        assert ru.decode_node == "decode-0" and ru.cached_tokens == 0
        for ch in s2:
            r2.add(ch)
        # decode-1's digest names turn 2's pages (the heartbeat carries it to the router) ...
        d1 = node_info(up.address, "decode-1").address
        pages = set(PrefixQuery(turn2).pages(BLOCK))
        wait_for(lambda: pages <= set(decode_stats(d1).prefix.pages), 10, "decode-1's digest to hold turn 2's pages")
        time.sleep(MEMORY_S + 1.0)  # ... which alone routes turn 3 once the router's memory of turn 2 is gone
        turn3 = turn2 + r2.token_ids + user3
        r3 = c.generate(prompt_token_ids=turn3, max_tokens=new, **greedy)
        # 9 new tokens after turn 2's reply: computed on decode-1 from turn 2's final state (its
        # last sampled token has no KV yet)
        assert (r3.decode_node, r3.prefill_node, r3.cached_tokens) == ("decode-1", "", len(turn2) + BUSY - 1)
    assert h.token_ids == hc.hf_greedy(ckpt, hold, BUSY)
    assert r1.token_ids == hc.hf_greedy(ckpt, turn1, new)
    assert r2.token_ids == hc.hf_greedy(ckpt, turn2, BUSY)
    assert ru.token_ids == hc.hf_greedy(ckpt, unrelated, new)
    assert r3.token_ids == hc.hf_greedy(ckpt, turn3, new)


def test_cache_salt_keeps_tenants_apart(up, ckpt):
    """`cache_salt` across the pools: the nodes' digests name a salted prompt's pages as the
    router names them with the salt (and not as without it), so a tenant's next turn is routed by
    the digests to the decode node holding its conversation and resumes there from the state its
    turn 1 ended with, while the same turn with another salt or none takes nothing cached."""
    from client import Client
    from router.prefix import PrefixQuery

    new = 5
    turn1, user2 = hc.prompts(lens=(3 * BLOCK + 5, 9), seed=43)
    greedy = dict(temperature=0.0, ignore_eos=True, max_tokens=new)
    with Client(up.address, timeout=180) as c:
        c.wait_ready(timeout=90)
        a1 = c.generate(prompt_token_ids=turn1, cache_salt="tenant-a", **greedy)
        assert a1.cached_tokens == 0
        d = node_info(up.address, a1.decode_node).address
        mine, plain = set(PrefixQuery(turn1, salt="tenant-a").pages(BLOCK)), set(PrefixQuery(turn1).pages(BLOCK))
        wait_for(lambda: mine <= set(decode_stats(d).prefix.pages), 10, "the decode node's digest to hold a's pages")
        assert not plain & set(decode_stats(d).prefix.pages)
        time.sleep(MEMORY_S + 1.0)  # the router routes a's next turn by the digests alone
        turn2 = turn1 + a1.token_ids + user2
        b = c.generate(prompt_token_ids=turn2, cache_salt="tenant-b", **greedy)
        u = c.generate(prompt_token_ids=turn2, **greedy)
        a2 = c.generate(prompt_token_ids=turn2, cache_salt="tenant-a", **greedy)
    assert (b.cached_tokens, u.cached_tokens) == (0, 0)
    assert (a2.decode_node, a2.prefill_node, a2.cached_tokens) == (a1.decode_node, "", len(turn1) + new - 1)
    assert a1.token_ids == hc.hf_greedy(ckpt, turn1, new)
    assert b.token_ids == u.token_ids == a2.token_ids == hc.hf_greedy(ckpt, turn2, new)

"""Cache-aware routing without processes: the router's view of a node's prefix cache (built from
the digest a real engine-side `PrefixCache` reports) gives the same usable prefix as the engine's
own lookup, and the policy trades cached tokens against load, never picks a node without room,
and is least-loaded when nothing is cached."""

from __future__ import annotations

import random

import pytest

from engine.cache.block_manager import BlockManager
from engine.cache.prefix import PrefixCache
from engine.prefix_hash import prompt_hashes
from proto import pb
from router.policy import MOVE_PENALTY, POOLED_PAGE_SAVING, LeastLoaded, decode_hit, make_policy
from router.prefix import NodeCache, PrefixQuery
from router.registry import NodeEntry

BS = 4


def _digest(pc: PrefixCache) -> pb.PrefixDigest:
    d = pc.digest()  # as serving/node.py puts it on the wire
    return pb.PrefixDigest(
        version=d.version,
        block_size=d.block_size,
        snapshot_interval=d.interval,
        pages=d.pages,
        snapshot_keys=d.snapshot_keys,
        snapshot_tokens=d.snapshot_tokens,
        mtp=d.mtp,
    )


def _cache(tokens: list[int], pages: int, snapshots: list[int], missing_page: int | None = None) -> PrefixCache:
    """A node's cache after it computed `tokens`: its first `pages` full pages registered (but
    `missing_page`, evicted) and GDN snapshots after each of `snapshots` tokens."""
    bm = BlockManager(64, BS)
    pc = PrefixCache(bm, num_snapshots=8, interval=8)
    hashes = prompt_hashes(tokens, BS)
    ids = bm.allocate(pages)
    for j in range(pages):
        if j != missing_page:
            bm.register(ids[j], hashes[j])
    bm.free(ids)  # cached, nobody using them
    for n in snapshots:
        s = pc.reserve(*pc.key_for(tokens, hashes, n), n)
        pc.commit(s)
    return pc


def _engine_usable(pc: PrefixCache, prompt: list[int]) -> int:
    hit = pc.lookup(prompt, prompt_hashes(prompt, BS), len(prompt) - 1)  # the scheduler's limit
    return hit.num_tokens if hit else 0


def _engine_pages(pc: PrefixCache, prompt: list[int]) -> int:
    n = 0
    for h in prompt_hashes(prompt, BS):
        if pc.blocks.lookup(h) is None:
            break
        n += 1
    return n * BS


rng = random.Random(3)
BASE = [rng.randrange(1000) for _ in range(30)]  # 7 full pages and 2 tokens
PROMPTS = {
    "extends": BASE + [5, 6, 7, 8, 9, 10],
    "same": list(BASE),  # the snapshot at its end is past the limit (the last token is computed)
    "diverges-at-20": BASE[:20] + [999] * 12,
    "diverges-at-3": BASE[:3] + [999] * 30,
    "short": BASE[:9],
}


@pytest.mark.parametrize("missing", [None, 3], ids=["all-pages", "page-3-evicted"])
@pytest.mark.parametrize("name", list(PROMPTS))
def test_usable_prefix_matches_the_engine_lookup(name, missing):
    """Compute: trimmed to the longest snapshot whose pages are all there; transfer: the leading pages."""
    pc = _cache(BASE, pages=7, snapshots=[8, 16, 26, 30], missing_page=missing)
    nc = NodeCache()
    nc.update(_digest(pc))
    q = PrefixQuery(PROMPTS[name])
    assert nc.usable(q, compute=True) == _engine_usable(pc, PROMPTS[name])
    assert nc.usable(q, compute=False) == _engine_pages(pc, PROMPTS[name])


def _mtp_cache(computed: list[list[int]], snapshots: list[tuple[int, int]]) -> PrefixCache:
    """An MTP node's cache after it computed each prompt of `computed` in turn (each full page
    registered with the token after it, the first computer's copy kept, as the scheduler does;
    a prompt's last page gets token 0 after it, its first sampled one) and GDN snapshots after
    (prompt index, tokens) of `snapshots`."""
    bm = BlockManager(64, BS)
    pc = PrefixCache(bm, num_snapshots=8, interval=8, mtp=True)
    for toks in computed:
        hashes = prompt_hashes(toks, BS)
        ids = bm.allocate(len(hashes))
        for j, h in enumerate(hashes):
            e = (j + 1) * BS
            bm.register(ids[j], h, toks[e] if e < len(toks) else 0)
        bm.free(ids)
    for i, n in snapshots:
        pc.commit(pc.reserve(*pc.key_for(computed[i], prompt_hashes(computed[i], BS), n), n))
    return pc


def _engine_mtp_pages(pc: PrefixCache, prompt: list[int]) -> int:
    """A decode node's reservation under MTP (Scheduler.reserve): leading pages cached with the
    prompt's own token after them."""
    n = 0
    for j, h in enumerate(prompt_hashes(prompt, BS)):
        e = (j + 1) * BS
        if pc.blocks.lookup(h, prompt[e] if e < len(prompt) else -1) is None:
            break
        n += 1
    return n * BS


# B1 and a branch of it exactly at the page boundary 16: page 3 is cached with B1's token 16 after
# it, so C1 shares 3 pages, not 4, and its snapshot at 16 (which keeps page 3 itself) is usable.
B1 = BASE[:26]
C1 = BASE[:16] + [998] * 10
MTP_PROMPTS = {
    "b1-next-turn": B1 + [5, 6, 7, 8, 9, 10],
    "c1-next-turn": C1 + [5, 6, 7, 8],
    "branch-at-16": BASE[:16] + [997] * 8,
    "ends-on-page": BASE[:20],  # its last page's next token is not known yet: never shared
    "branch-at-12": BASE[:12] + [996] * 9,
}


@pytest.mark.parametrize("name", list(MTP_PROMPTS))
def test_mtp_usable_prefix_matches_the_engine_lookup(name):
    """With MTP drafting the digest names each page with the token after it: the router's usable
    prefix still equals the engine's lookup where a prompt branches at a page end."""
    pc = _mtp_cache([B1, C1], snapshots=[(0, 8), (0, 16), (0, 26), (1, 24)])
    nc = NodeCache()
    nc.update(_digest(pc))
    assert nc.mtp
    prompt = MTP_PROMPTS[name]
    q = PrefixQuery(prompt)
    assert nc.usable(q, compute=True) == _engine_usable(pc, prompt)
    assert nc.usable(q, compute=False) == _engine_mtp_pages(pc, prompt)


def test_trimmed_to_the_last_snapshot():
    pc = _cache(BASE, pages=7, snapshots=[8, 16])
    nc = NodeCache()
    nc.update(_digest(pc))
    q = PrefixQuery(PROMPTS["extends"])
    assert nc.usable(q, compute=False) == 28  # every page
    assert nc.usable(q, compute=True) == 16 == _engine_usable(pc, PROMPTS["extends"])
    nc.update(_digest(_cache(BASE, pages=3, snapshots=[8, 16])))  # pages 3.. gone: 16 is not usable
    assert nc.usable(q, compute=True) == 8


def test_a_finished_reply_is_seen_in_the_digest():
    """A node's scheduler (a stand-in model that samples token 7) runs turn 1 to the end; the
    digest names its reply pages and its final-state snapshot, and the router finds in it the
    same usable prefix of turn 2 as the engine: 33 tokens computing (30 + 4 - 1, the last token
    has no KV), 32 receiving (8 full pages)."""
    from engine.cache.block_manager import SlotPool
    from engine.config import SchedulerConfig
    from engine.request import Request
    from engine.sampling_params import SamplingParams
    from engine.scheduler import Scheduler

    bm = BlockManager(64, BS)
    pc = PrefixCache(bm, num_snapshots=8, interval=8)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), bm, SlotPool(2), 1000, prefix=pc)
    r = Request("t1", list(BASE), SamplingParams(max_tokens=4, ignore_eos=True))
    sched.add(r)
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, {row.request.request_id: [7] for row in out.rows if row.samples}, ())
        sched.end_final(sched.take_final(), ran=True)
    turn2 = BASE + [7] * 4 + [1, 2, 3]
    nc = NodeCache()
    nc.update(_digest(pc))
    q = PrefixQuery(turn2)
    assert nc.usable(q, compute=True) == _engine_usable(pc, turn2) == len(BASE) + 3
    assert nc.usable(q, compute=False) == _engine_pages(pc, turn2) == (len(BASE) + 3) // BS * BS


@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
def test_a_finished_reply_is_remembered_before_the_digest(mtp):
    """A node's scheduler runs turn 1 to the end (with MTP drafting too, its drafts all rejected:
    depth 0); the router, whose last digest predates it, remembers what the request it placed
    ends with there (`remember_end`: turn 1's prompt and reply) and finds the usable prefix of
    turn 2 that the engine's own lookup finds, before the next digest. Before, only the prompt
    was remembered: turn 2 saw turn 1's prompt end and went to the prefill pool."""
    from engine.cache.block_manager import SlotPool
    from engine.config import SchedulerConfig, SpeculativeConfig
    from engine.request import Request
    from engine.sampling_params import SamplingParams
    from engine.scheduler import Scheduler

    bm = BlockManager(64, BS)
    pc = PrefixCache(bm, num_snapshots=8, interval=8, mtp=mtp)
    spec = SpeculativeConfig(num_tokens=1 if mtp else 0, method="mtp")
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    sched = Scheduler(cfg, bm, SlotPool(2), 1000, spec.num_tokens, spec=spec, prefix=pc)
    r = Request("t1", list(BASE), SamplingParams(max_tokens=6, ignore_eos=True))
    sched.add(r)
    nc = NodeCache()
    nc.update(_digest(pc))  # before turn 1: nothing cached
    nc.remember(PrefixQuery(BASE), compute=True, ttl_s=10.0, now=100.0)  # placed (computed there)
    while sched.has_unfinished():
        out = sched.schedule()
        sampled = {row.request.request_id: [7] for row in out.rows if row.samples}
        drafts = {rid: [8] for rid in sampled} if mtp else None  # always rejected (7 is drawn)
        sched.update(out, sampled, (), drafts)
        sched.end_final(sched.take_final(), ran=True)
    assert (not mtp or r.spec.depth == 0) and bm.num_free == 64 and not bm.ref  # the held pages are back
    turn2 = PrefixQuery(BASE + r.output_token_ids + [1, 2, 3])
    engine = _engine_usable(pc, turn2.ids)
    assert engine == len(BASE) + 6 - 1  # its final state
    assert nc.usable(turn2, compute=True, now=101.0) == len(BASE)  # the prompt's end alone
    nc.remember_end(PrefixQuery(BASE + r.output_token_ids), ttl_s=10.0, now=101.0)
    assert nc.usable(turn2, compute=True, now=102.0) == engine
    assert nc.usable(turn2, compute=True, now=112.0) == 0  # expired


def test_remembered_placement_counts_until_it_expires():
    """A prompt placed on a node counts as cached there before its digest says so."""
    nc = NodeCache()
    nc.update(pb.PrefixDigest(version=1, block_size=BS, snapshot_interval=8))
    turn1 = PrefixQuery(BASE)
    turn2 = PrefixQuery(BASE + [1, 2, 3, 4, 5])
    nc.remember(turn1, compute=True, ttl_s=10.0, now=100.0)
    assert nc.usable(turn2, compute=True, now=101.0) == len(BASE)  # the snapshot at turn 1's end
    assert nc.usable(turn2, compute=False, now=101.0) == len(BASE) // BS * BS
    assert nc.usable(turn2, compute=True, now=111.0) == 0  # expired
    other = NodeCache()
    other.update(pb.PrefixDigest(version=1, block_size=BS, snapshot_interval=8))
    other.remember(turn1, compute=False, ttl_s=10.0, now=100.0)  # a transfer: pages + the landed state
    assert other.usable(turn2, compute=True, now=101.0) == len(BASE)
    assert other.usable(turn2, compute=False, now=101.0) == 28
    mtp = NodeCache()  # with MTP a decode node keeps no landed state (PrefixPlanner.keep_landed)
    mtp.update(pb.PrefixDigest(version=1, block_size=BS, snapshot_interval=8, mtp=True))
    mtp.remember(turn1, compute=False, ttl_s=10.0, now=100.0)
    assert mtp.usable(turn2, compute=True, now=101.0) == 0


def _node(node_id, kind=pb.NODE_KIND_DECODE, free_blocks=100, free_slots=8, queued=0):
    return NodeEntry(
        pb.NodeInfo(
            node_id=node_id,
            kind=kind,
            address=f"{node_id}:1",
            incarnation=1,
            capacity=pb.Capacity(
                total_blocks=100,
                free_blocks=free_blocks,
                block_size=BS,
                total_slots=8,
                free_slots=free_slots,
                queued_prefill_tokens=queued,
            ),
        )
    )


def _holding(e: NodeEntry, tokens: list[int]) -> NodeEntry:
    e.cache.update(_digest(_cache(tokens, pages=len(tokens) // BS, snapshots=[len(tokens)])))
    return e


def test_decode_choice_trades_the_cached_prefix_against_load():
    pol = make_policy("cache-aware", load_weight=0.1)
    prompt = BASE + [1, 2, 3, 4]
    q = PrefixQuery(prompt)
    a, b = _holding(_node("a"), BASE), _node("b")
    assert pol.choose_decode([b, a], len(prompt), q) is a  # 30 cached tokens
    a.info.capacity.queued_prefill_tokens = 31  # more queued work than the hit saves
    assert pol.choose_decode([b, a], len(prompt), q) is b
    a.info.capacity.queued_prefill_tokens = 29
    assert pol.choose_decode([b, a], len(prompt), q) is a
    a.info.capacity.free_blocks = 60  # 40 pages = 160 KV tokens held: 16 tokens of work
    assert pol.choose_decode([b, a], len(prompt), q) is b
    # never a node without room, however much it holds
    a.info.capacity.queued_prefill_tokens, a.info.capacity.free_blocks, a.info.capacity.free_slots = 0, 100, 0
    assert pol.choose_decode([b, a], len(prompt), q) is b
    assert pol.choose_decode([a], len(prompt), q) is None


def test_pooled_prompt_uses_the_pages_and_the_pool_decision_discounts_the_hit():
    prompt = BASE + [1, 2, 3, 4]
    q = PrefixQuery(prompt)
    a = _holding(_node("a"), BASE)
    asked = []

    def pooled(e, uncached):
        asked.append(uncached)
        return uncached >= 10  # a local-prefill threshold of 10 tokens

    assert decode_hit(a, q, pooled) == (30, False)  # 4 tokens left: prefilled on a, from the snapshot
    assert asked == [len(prompt) - 30]
    assert decode_hit(a, PrefixQuery(BASE + list(range(20))), pooled) == (28, True)  # pages only


def test_pooled_prompts_go_by_load_not_by_pages():
    """Pages on a decode node save a pooled prompt only their transfer (the pool computes it either
    way: POOLED_PAGE_SAVING of a token each), so a node holding them but more load loses it; the
    same prompt computed on the decode node keeps the node that holds its prefix."""
    pol = make_policy("cache-aware", load_weight=0.1)
    prompt = BASE + list(range(20))
    q = PrefixQuery(prompt)
    a, b = _holding(_node("a", free_blocks=90), BASE), _node("b", free_blocks=100)  # a: 160 KV tokens held

    def always(e, uncached):
        return True

    def never(e, uncached):
        return False

    assert pol.choose_decode([a, b], len(prompt), q, always) is b  # 16 tokens of load against 2.8 saved
    assert pol.choose_decode([a, b], len(prompt), q, never) is a  # computed there: 30 cached tokens save work
    b.info.capacity.free_blocks = 80  # now b holds more: a wins the pooled prompt on load alone
    assert pol.choose_decode([a, b], len(prompt), q, always) is a


def test_nothing_cached_is_least_loaded():
    pol, ll = make_policy("cache-aware"), LeastLoaded()
    nodes = [_node("a", free_slots=3), _node("b", free_slots=6), _node("c", free_slots=6, free_blocks=50)]
    unrelated = PrefixQuery([7] * 33)
    _holding(nodes[0], BASE)  # holds something else
    assert pol.choose_decode(nodes, 33, unrelated) is ll.choose_decode(nodes, 33) is nodes[1]
    ps = [_node("p1", pb.NODE_KIND_PREFILL, queued=50), _node("p2", pb.NODE_KIND_PREFILL, queued=20)]
    assert pol.choose_prefill(ps, 33, unrelated) is ll.choose_prefill(ps, 33) is ps[1]


def test_prefill_choice_weighs_the_hit_against_queued_tokens():
    pol = make_policy("cache-aware")
    prompt = BASE + [1, 2, 3, 4]
    q = PrefixQuery(prompt)
    p1 = _holding(_node("p1", pb.NODE_KIND_PREFILL, queued=20), BASE)
    p2 = _node("p2", pb.NODE_KIND_PREFILL)
    assert pol.choose_prefill([p2, p1], len(prompt), q) is p1  # 4 + 20 tokens of work against 34
    p1.inflight_prefill_tokens = 20  # the router's own, not yet reported
    assert pol.choose_prefill([p2, p1], len(prompt), q) is p2
    # a report that still counts a prompt whose first token is back: that prompt is done there
    p1.inflight_prefill_tokens, p1.info.capacity.queued_prefill_tokens, p1.prefilled_tokens = 0, 400, 390
    assert pol.choose_prefill([p2, p1], len(prompt), q) is p1
    p1.reported()  # a fresh report (still 400 queued) replaces the discount
    assert pol.choose_prefill([p2, p1], len(prompt), q) is p2
    assert pol.choose_prefill([], len(prompt), q) is None


def test_router_hashing_loads_no_torch():
    import subprocess
    import sys

    code = "import sys, router.policy, router.prefix, router.service; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_conversation_stays_with_its_history_but_new_ones_spread():
    """A node holding the shared start of a prompt (a system prompt) but not the conversation's own
    history computes that history again, priced MOVE_PENALTY more: a follow-up turn stays on the
    node that holds it through a queue that would have moved it. A node holding none of the prompt
    is priced as before, so new conversations sharing a system prompt do not all pile onto the node
    that computed it first."""
    pol = make_policy("cache-aware", load_weight=0.0)
    history = BASE + [rng.randrange(1000) for _ in range(40)]  # the system prompt, then a conversation
    prompt = history + [1, 2, 3, 4]
    q = PrefixQuery(prompt)
    a, b = _holding(_node("a"), history), _holding(_node("b"), BASE)
    ha, hb = a.cache.usable(q, compute=True), b.cache.usable(q, compute=True)
    assert 0 < hb < ha
    # a's queue against b's cost: without the penalty b would win from a queue of ha - hb on
    a.info.capacity.queued_prefill_tokens = (ha - hb) + 1
    assert pol.choose_decode([b, a], len(prompt), q) is a
    a.info.capacity.queued_prefill_tokens = int((1 + MOVE_PENALTY) * (ha - hb)) + 1
    assert pol.choose_decode([b, a], len(prompt), q) is b
    # a new conversation: c holds nothing, so a's queue past the hit sends it to c
    c = _node("c")
    a.info.capacity.queued_prefill_tokens = ha + 1
    assert pol.choose_decode([c, a], len(prompt), q) is c


def test_a_follow_up_does_not_escape_to_the_pool_on_a_small_queue():
    """The same for a node that would send the prompt to the prefill pool: the pool computes again
    the history the conversation's node holds, and the conversation's next turns follow the state
    to the new node, so that move pays MOVE_PENALTY on the history too."""
    pol = make_policy("cache-aware", load_weight=0.0)
    history = BASE + [rng.randrange(1000) for _ in range(40)]
    prompt = history + [1, 2, 3, 4]
    q = PrefixQuery(prompt)
    a, b = _holding(_node("a"), history), _holding(_node("b"), BASE)
    ha, hb = a.cache.usable(q, compute=True), b.cache.usable(q, compute=True)

    def pooled(e, uncached):
        return e is b  # b would send it to the pool; a computes it itself

    pages_b = b.cache.usable(q, compute=False)
    # without the penalty b wins from a queue on a of ha - 0.1 x b's pages
    a.info.capacity.queued_prefill_tokens = int(ha - POOLED_PAGE_SAVING * pages_b) + 1
    assert pol.choose_decode([b, a], len(prompt), q, pooled) is a
    a.info.capacity.queued_prefill_tokens += int(MOVE_PENALTY * (ha - hb)) + 1
    assert pol.choose_decode([b, a], len(prompt), q, pooled) is b

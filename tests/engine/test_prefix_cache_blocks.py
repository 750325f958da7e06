"""Prefix caching bookkeeping: exact page ids, reference counts, free counts and snapshot entries
after a miss, a hit, eviction, abort, preemption, the release of held memory, and a finished
request's reply pages and final-state snapshot (a conversation's next turn).

The scheduler runs with a stand-in for the model (every sampling row gets token 7), so the
expected values below are worked out by hand from the rules in engine/cache/prefix.py."""

from __future__ import annotations

import argparse

import pytest

from engine.cache.block_manager import BlockManager, SlotPool
from engine.cache.prefix import ROOT_HASH, PrefixCache, block_hash
from engine.config import EngineArgs, SchedulerConfig, SpeculativeConfig
from engine.options import add_options, options, to_argv, values
from engine.request import Request, Status
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.step import SnapshotCopy

PROMPT = list(range(1, 11))  # 10 tokens: pages [1..4] [5..8], then a partial page [9, 10]


def make(num_blocks=8, snaps=4):
    blocks = BlockManager(num_blocks, 4)
    slots = SlotPool(2)
    prefix = PrefixCache(blocks, snaps, interval=4)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    return Scheduler(cfg, blocks, slots, 1000, prefix=prefix), blocks, slots, prefix


def req(rid, prompt, max_tokens=2, prefill_only=False):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), prefill_only=prefill_only)


def step(sched):
    out = sched.schedule()
    sched.update(out, {r.request.request_id: [7] for r in out.rows if r.samples}, ())
    sched.end_final(sched.take_final(), ran=True)  # EngineCore copies finished requests' final state
    return out


def run_first(sched):
    """Request a: prompt PROMPT, 2 new tokens. The prompt runs in one chunk [0, 10) that saves the
    snapshots on the grid (every 4 tokens) inside it from the forward (offsets 4, 8) and the one at
    the prompt's end from the slot after it, then one decode step, after which the final state
    (11 tokens: the last sampled one has no KV) is saved into entry 3."""
    a = req("a", PROMPT)
    sched.add(a)
    out = step(sched)
    assert [r.num_new_tokens for r in out.rows] == [10]
    saves = [c for _, c in out.saves]
    assert saves == [SnapshotCopy(0, 0, None, 4), SnapshotCopy(1, 0, None, 8), SnapshotCopy(2, 0, 2)]
    assert a.block_ids == [0, 1, 2] and a.output_token_ids == [7]
    step(sched)
    assert a.status is Status.FINISHED
    return a


H0 = block_hash(ROOT_HASH, [1, 2, 3, 4])
H1 = block_hash(H0, [5, 6, 7, 8])


def test_miss_then_hit_shares_pages_and_copies_the_partial_page():
    sched, blocks, slots, prefix = make()
    run_first(sched)
    # pages 0 and 1 are cached (full prompt pages), page 2 is not; none is in use
    assert blocks.cached == {H0: 0, H1: 1} and blocks.ref == {} and blocks.num_free == 8
    assert prefix.num_used == 4 and prefix.stats.saved == 4

    b = req("b", PROMPT + [20, 21], max_tokens=1)
    sched.add(b)
    out = sched.schedule()
    # the snapshot at 10 (end of a's prompt) with pages 0, 1 shared; a fresh page (3) takes a
    # copy of the partial page; the slot takes the snapshot's state
    assert b.num_computed_tokens == 10 and b.num_cached_tokens == 10
    assert b.block_ids == [0, 1, 3] and blocks.ref == {0: 1, 1: 1, 3: 1} and blocks.num_free == 5
    assert [c for _, c in out.restores] == [SnapshotCopy(2, b.slot, 3)]
    assert [r.num_new_tokens for r in out.rows] == [2]
    # b's prompt end (12) is saved into the least recently used entry (4 tokens: entry 0)
    assert [c for _, c in out.saves] == [SnapshotCopy(0, b.slot, None)] and prefix.stats.evicted == 1
    assert out.restores[0][0].ref == 1  # pinned while the step runs
    sched.update(out, {"b": [7]}, ())
    assert out.restores[0][0].ref == 0 and b.status is Status.FINISHED
    assert blocks.ref == {} and blocks.num_free == 8 and slots.num_free == 2
    assert blocks.cached[block_hash(H1, [9, 10, 20, 21])] == 3
    assert (prefix.stats.query_tokens, prefix.stats.hit_tokens) == (22, 10)


def test_hit_is_trimmed_to_the_last_snapshot_and_the_pages_still_cached():
    sched, blocks, slots, prefix = make(snaps=5)
    run_first(sched)
    # between snapshots: 9 shared tokens resume at the grid snapshot 8
    c = req("c", PROMPT[:9] + [30, 31])
    sched.add(c)
    step(sched)
    assert c.num_cached_tokens == 8 and c.block_ids[:2] == [0, 1]
    sched.finish(c, "abort")
    assert blocks.ref == {} and blocks.num_free == 8
    # another request's demand hands out every free page but one: the cached page 1 is evicted
    # (pages freed last are handed out last; a chain's deeper page is freed first)
    held = blocks.allocate(7)
    assert 1 in held and 0 not in held and blocks.cached == {H0: 0} and blocks.num_evicted == 1
    blocks.free(held)
    d = req("d", PROMPT + [40])
    sched.add(d)
    step(sched)
    assert d.num_cached_tokens == 4 and d.block_ids[0] == 0  # page 1 is gone: only the snapshot at 4 is usable


def test_abort_and_preemption_never_free_a_page_another_request_uses():
    sched, blocks, slots, prefix = make()
    run_first(sched)
    b, c = req("b", PROMPT + [50], max_tokens=4), req("c", PROMPT + [60], max_tokens=4)
    sched.add(b)
    sched.add(c)
    out = sched.schedule()
    assert [r.request.request_id for r in out.rows] == ["b", "c"]
    assert b.block_ids[:2] == c.block_ids[:2] == [0, 1] and blocks.ref[0] == blocks.ref[1] == 2
    assert out.restores[0][0] is out.restores[1][0] and out.restores[0][0].ref == 2
    sched.update(out, {"b": [7], "c": [7]}, ())
    sched.finish(b, "abort")  # b's own pages are free, the shared ones still c's
    assert blocks.ref == {0: 1, 1: 1, c.block_ids[2]: 1} and blocks.num_free == 5 and not blocks.is_free(0)
    sched._preempt(c)  # c gives everything back and recomputes later, from the cache
    assert blocks.ref == {} and blocks.num_free == 8 and slots.num_free == 2
    step(sched)
    # back from the prefix: prompt + its first token; the snapshot at the prompt's end (11) is usable
    assert c.status is Status.RUNNING and c.num_computed_tokens == 12 and c.block_ids[:2] == [0, 1]
    assert c.num_cached_tokens == 10  # what its first admission took from the cache
    while c.status is not Status.FINISHED:
        step(sched)
    assert blocks.ref == {} and blocks.num_free == 8 and slots.num_free == 2
    assert all(s.ref == 0 for s in prefix._by_key.values())


def test_held_and_released_prefill_keeps_shared_pages_until_release():
    sched, blocks, slots, prefix = make()
    run_first(sched)
    p = req("p", PROMPT + [70, 71], prefill_only=True)
    sched.add(p)
    step(sched)
    assert p.status is Status.HELD and p.block_ids[:2] == [0, 1] and blocks.ref[0] == 1
    sched.finish(p, "prefilled")  # the transfer read it (or the node it pushed to died)
    assert blocks.ref == {} and blocks.num_free == 8 and slots.num_free == 2


def test_snapshot_pool_full_of_pinned_entries_saves_nothing():
    sched, blocks, slots, prefix = make(snaps=1)
    first = prefix.reserve(ROOT_HASH, (1,), 1)
    assert first is not None and prefix.reserve(ROOT_HASH, (2,), 1) is None  # the only entry is being written
    prefix.commit(first)
    assert prefix.reserve(ROOT_HASH, (1,), 1) is None  # saved already: kept, not written twice
    second = prefix.reserve(ROOT_HASH, (2,), 1)
    assert second.index == first.index and prefix.stats.evicted == 1
    with pytest.raises(ValueError, match="released more often"):
        prefix.release(first)


def test_prefix_caching_flag_is_generated_from_the_option():
    opts = options(EngineArgs)
    assert to_argv(opts, {"enable_prefix_caching": False}) == ["--no-prefix-caching"]
    parser = argparse.ArgumentParser()
    add_options(parser, opts)
    got = values(opts, parser.parse_args(["--no-prefix-caching", "--prefix-snapshot-interval", "64"]))
    assert got["enable_prefix_caching"] is False and got["prefix_snapshot_interval"] == 64
    assert values(opts, parser.parse_args([]))["enable_prefix_caching"] is True


# ---- reply pages and final-state snapshots (a conversation's next turn) ----------------------
H2 = block_hash(H1, [9, 10, 7, 7])  # PROMPT's partial page completed by the reply's first tokens


def _finish_a(sched):
    """Request a (PROMPT, 4 tokens of 7) run to its end."""
    a = req("a", PROMPT, max_tokens=4)
    sched.add(a)
    for _ in range(3):
        step(sched)
    sched.update(sched.schedule(), {"a": [7]}, ())
    return a


def test_finished_reply_pages_and_final_state_serve_the_next_turn():
    """a: PROMPT + 4 tokens [7, 7, 7, 7]; 13 computed (the last token has no KV): pages 0-2 full and
    cached, the final state at 13 saved with page 3 (positions 12..) held until the copy ran."""
    sched, blocks, slots, prefix = make(snaps=5)
    a = _finish_a(sched)
    assert a.status is Status.FINISHED and a.output_token_ids == [7] * 4
    assert blocks.cached == {H0: 0, H1: 1, H2: 2}
    assert blocks.ref == {3: 1} and slots.num_free == 1  # held for the copy, not yet free
    final = sched.take_final()
    assert [f.copy for f in final] == [SnapshotCopy(3, 0, 3)] and final[0].snapshot.num_tokens == 13
    sched.end_final(final, ran=True)
    assert blocks.ref == {} and blocks.num_free == 8 and slots.num_free == 2 and prefix.stats.saved == 4

    # turn 2 = turn 1's prompt + reply + new tokens: resumes at 13, past the reply
    b = req("b", PROMPT + [7] * 4 + [80, 81], max_tokens=1)
    sched.add(b)
    out = sched.schedule()
    assert b.num_cached_tokens == 13 and b.block_ids[:3] == [0, 1, 2] and [r.num_new_tokens for r in out.rows] == [3]
    assert [c for _, c in out.restores] == [SnapshotCopy(3, b.slot, b.block_ids[3])]
    sched.update(out, {"b": [7]}, ())
    sched.end_final(sched.take_final(), ran=True)
    assert blocks.ref == {} and blocks.num_free == 8 and slots.num_free == 2
    assert all(s.ref == 0 for s in prefix._by_key.values())


def test_final_copy_that_fails_frees_its_entry_and_memory():
    sched, blocks, slots, prefix = make(snaps=5)
    _finish_a(sched)
    final = sched.take_final()
    sched.end_final(final, ran=False)
    assert blocks.ref == {} and blocks.num_free == 8 and slots.num_free == 2
    assert prefix.num_used == 3 and not final[0].snapshot.ready  # only the prompt's three


@pytest.mark.parametrize("how", ["abort", "preempt"])
def test_request_stopped_mid_decode_registers_only_what_it_wrote(how):
    """a decodes 3 tokens (13 tokens computed, the 14th sampled): pages 0-2 are cached, page 3
    (positions 12, 13: 13 not written) is not, no final snapshot, nothing held."""
    sched, blocks, slots, prefix = make(snaps=5)
    a = req("a", PROMPT, max_tokens=8)
    sched.add(a)
    for _ in range(4):
        step(sched)
    assert a.num_computed_tokens == 13 and len(a.output_token_ids) == 4
    if how == "abort":
        sched.finish(a, "abort")
    else:
        sched._preempt(a)
    assert sched.take_final() == []
    assert blocks.cached == {H0: 0, H1: 1, H2: 2} and blocks.ref == {} and blocks.num_free == 8
    assert slots.num_free == 2 and prefix.num_used == 3
    if how == "preempt":  # back from the cache: the prompt-end snapshot, then the rest recomputed
        while a.status is not Status.FINISHED:
            step(sched)
        assert a.num_cached_tokens == 0 and len(a.output_token_ids) == 8
        assert blocks.ref == {} and blocks.num_free == 8 and slots.num_free == 2


def test_rejected_drafts_never_reach_a_registered_page():
    """n-gram drafting: every row carries 3 drafts (99) the stand-in model rejects, so KV slots
    past num_computed_tokens hold drafts; only pages fully below it are cached, under the hashes
    of the verified tokens."""
    blocks, slots = BlockManager(8, 4), SlotPool(2)
    prefix = PrefixCache(blocks, 4, interval=4)
    spec = SpeculativeConfig(num_tokens=3)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    sched = Scheduler(cfg, blocks, slots, 1000, 3, lambda toks, k: [99] * k, spec, prefix)
    a = req("a", PROMPT, max_tokens=5)
    sched.add(a)
    step(sched)
    out = step(sched)
    assert out.rows[0].draft_token_ids == [99, 99, 99]  # positions 11..13 hold drafts' KV
    assert a.num_computed_tokens == 11 and blocks.cached == {H0: 0, H1: 1}
    step(sched)  # 12 computed: page 2 = [9, 10, 7, 7] is verified
    assert blocks.cached == {H0: 0, H1: 1, H2: 2}


def test_decode_side_reserve_shares_reply_pages_and_counts_them_as_hits():
    """A decode node: turn 1 arrives by transfer and decodes 4 tokens; its reply pages are cached,
    the state that landed is kept at the prompt's end (10 tokens: entry 0 with the partial page 2,
    copied before the first decode step) and the final state at 13 (entry 1, page 3). Turn 2's
    reservation shares pages 0-2, counted as 12 hit tokens."""
    sched, blocks, slots, prefix = make(snaps=5)
    a = req("a", PROMPT, max_tokens=4)
    assert sched.reserve(a) and a.num_cached_blocks == 0
    sched.activate(a, 7, ())
    out = step(sched)
    assert [c for _, c in out.landed] == [SnapshotCopy(0, 0, 2)] and out.saves == []
    while a.status is not Status.FINISHED:
        assert step(sched).landed == []  # once
    assert blocks.cached == {H0: 0, H1: 1, H2: 2} and prefix.num_used == 2
    assert blocks.ref == {} and blocks.num_free == 8 and slots.num_free == 2
    b = req("b", PROMPT + [7] * 4 + [80, 81])
    assert sched.reserve(b) and b.num_cached_blocks == 3 and b.block_ids[:3] == [0, 1, 2]
    assert (prefix.stats.query_tokens, prefix.stats.hit_tokens) == (10 + 16, 12)
    sched.finish(b, "abort")
    assert blocks.ref == {} and blocks.num_free == 8 and slots.num_free == 2


@pytest.mark.parametrize("turn2, hit, entry", [(PROMPT + [50, 51], 10, 0), (PROMPT + [7, 7, 7, 80], 13, 1)])
def test_decode_side_turn_computed_here_resumes_from_the_landed_or_final_state(turn2, hit, entry):
    """The next turn of a conversation whose first turn arrived by transfer, computed on the decode
    node itself: from the landed state when it departs after the prompt, from the final state when
    it keeps the reply."""
    sched, blocks, slots, prefix = make(snaps=5)
    a = req("a", PROMPT, max_tokens=4)
    assert sched.reserve(a)
    sched.activate(a, 7, ())
    while a.status is not Status.FINISHED:
        step(sched)
    b = req("b", turn2)
    sched.add(b)
    out = step(sched)
    assert [(c.index, c.page is not None) for _, c in out.restores] == [(entry, True)]
    assert [r.num_new_tokens for r in out.rows] == [len(turn2) - hit]
    assert b.num_cached_tokens == hit


def test_landed_state_of_a_request_gone_before_its_first_step_is_not_kept():
    """Aborted between its activation and the next step: its entry goes back unwritten."""
    sched, blocks, slots, prefix = make(snaps=5)
    a = req("a", PROMPT, max_tokens=4)
    assert sched.reserve(a)
    sched.activate(a, 7, ())
    sched.finish(a, "abort")
    out = step(sched)
    assert out.landed == [] and prefix.num_used == 0
    assert blocks.ref == {} and slots.num_free == 2


def test_grid_points_and_the_superseded_prompt_end_go_before_the_final_state():
    """a's snapshots: grid points 4 and 8 (entries 0, 1), its prompt's end 10 (2) and its final
    state 11 (3), the conversation's deepest point, which its next turn resumes from when it keeps
    the reply id for id: saving it made the prompt's end an intermediate point (cold, behind the
    grid points). A grid point of a prompt running now takes only cold entries, never the final
    state (None once they are gone); a prompt's end or another final state takes it last."""
    sched, blocks, slots, prefix = make()
    run_first(sched)
    by_n = {s.num_tokens: s for s in prefix._by_key.values()}
    assert [(n, by_n[n].index, by_n[n].tier) for n in sorted(by_n)] == [(4, 0, 0), (8, 1, 0), (10, 2, 0), (11, 3, 1)]
    taken = []
    for tail in [(30,), (31,), (32,)]:
        s = prefix.reserve(ROOT_HASH, tail, 1, cold=True)
        taken.append(s.index)
        prefix.commit(s)
    assert taken == [0, 1, 2]  # the grid, then the superseded end
    for tail in [(30,), (31,), (32,)]:  # the new grid points themselves
        prefix.acquire(prefix.find(ROOT_HASH, tail))  # pinned: a step reads them
    assert prefix.reserve(ROOT_HASH, (33,), 1, cold=True) is None  # the final state stays
    later = prefix.reserve(ROOT_HASH, (34,), 1, final=True)  # another conversation's: the older goes
    assert later is not None and later.index == 3
    assert prefix._by_key.get((by_n[11].parent, by_n[11].tail)) is None


def test_a_final_state_resumed_once_goes_cold_and_twice_is_kept_warm():
    """A next turn that resumes from a's final state (its history keeps the reply) saves its own,
    deeper one: the resumed one is superseded and goes cold behind the grid points and the prompt's
    end. Resumed a second time (a regenerated turn), it is warm: newer saves take the others."""
    sched, blocks, slots, prefix = make()
    run_first(sched)
    final = next(s for s in prefix._by_key.values() if s.num_tokens == 11)
    prefix.acquire(final)  # a step restores from it
    prefix.release(final)
    assert final.cold and list(prefix._cold)[-1] is final
    prefix.acquire(final)
    prefix.release(final)
    assert not final.cold and final.tier == 2
    taken = []
    for tail in [(30,), (31,), (32,)]:
        s = prefix.reserve(ROOT_HASH, tail, 1)
        taken.append(s.index)
        prefix.commit(s)
    assert taken == [0, 1, 2]
    assert sorted(s.num_tokens for s in prefix._by_key.values()) == [1, 1, 1, 11]


def test_a_prompt_end_resumed_once_goes_first_and_a_shared_point_stays():
    """Two saved points, one a prompt's end (end=True: a conversation's turn) and one not (a
    branch where prompts part). A request resuming from each (the next turn; a new conversation
    sharing the branch) then saves its own longer end: the old end is superseded and is evicted
    before the branch, though resumed from later. Resumed a second time (a regenerated turn), an
    end is warm again."""
    _, _, _, prefix = make(snaps=4)
    end = prefix.reserve(ROOT_HASH, (40,), 1, end=True)
    branch = prefix.reserve(ROOT_HASH, (41,), 1)
    for s in (end, branch):
        prefix.commit(s)  # saved: unpinned
    prefix.acquire(branch)
    prefix.release(branch)
    prefix.acquire(end)  # resumed from after the branch: newer in a plain LRU
    prefix.release(end)
    assert end.cold and not branch.cold
    first = prefix.reserve(ROOT_HASH, (42,), 1)
    second = prefix.reserve(ROOT_HASH, (43,), 1)
    assert first is not None and second is not None  # two free entries of four
    third = prefix.reserve(ROOT_HASH, (44,), 1)
    assert third is not None and third.index == end.index  # the superseded end went first
    assert prefix._by_key.get((ROOT_HASH, (41,))) is branch
    # an end resumed twice earns its place
    again = prefix.reserve(ROOT_HASH, (45,), 1, end=True)
    assert again is not None and again.index == branch.index  # the branch was the only one left
    prefix.commit(again)
    for _ in range(2):
        prefix.acquire(again)
        prefix.release(again)
    assert not again.cold

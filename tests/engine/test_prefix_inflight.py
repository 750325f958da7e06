"""Prefix sharing between requests in flight (engine/cache/inflight.py): requests that share a new
prefix and arrive together compute it once. The first is admitted, the others wait one step for
its snapshot and resume from it; greedy float32 tokens and prompt logprobs equal the cache-off
run's and transformers'. A request whose sharer is gone is admitted as usual; a short shared
prefix, or one small next to the request's own tokens, holds nothing, and a held request does not
block those behind it."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cache.block_manager import BlockManager, SlotPool
from engine.cache.prefix import PrefixCache
from engine.config import SchedulerConfig
from engine.request import Request, Status
from engine.scheduler import Scheduler
from serving.loop import EngineLoop
from serving.metrics import capacity_gauges
from tests.helpers import hybrid_ckpt as hc

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _rand(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


CONTEXT = _rand(90, 40)  # 2.8 snapshot intervals of 32: grid snapshots at 32 and 64 inside it
ENDINGS = [CONTEXT + _rand(6, 41 + i) for i in range(4)]


def _all_free(llm) -> None:
    e, cap = llm.engine, llm.capacity()
    assert (e.blocks.num_free, e.slots.num_free) == (cap.num_blocks, cap.num_state_slots)
    assert not e.blocks.ref and all(s.ref == 0 for s in e.prefix._by_key.values())
    assert not e.scheduler.waiting and not e.scheduler.running


def test_a_burst_sharing_a_new_prefix_computes_it_once(ckpt_hv2):
    with LLM(ckpt_hv2, dtype="float32", enable_prefix_caching=False) as llm:
        off = llm.generate(prompt_token_ids=ENDINGS, sampling_params=GREEDY)
    with LLM(ckpt_hv2, dtype="float32", prefix_snapshot_interval=32) as llm:
        on = llm.generate(prompt_token_ids=ENDINGS, sampling_params=GREEDY)
        _all_free(llm)
        lp = EngineLoop(llm.engine, name="test-inflight").start()  # the node's metrics read its Snapshot
        try:
            assert capacity_gauges(lp.stats().result(5))["prefix_held_admissions_total"][1] == 3
        finally:
            lp.stop()
    # step 1: the first computes all 96 tokens, the others wait for its grid snapshot at 64; step
    # 2: the second resumes there and saves one at its branch (the 5 full pages it shares, 80
    # tokens); the last two skip 16 tokens each by waiting for that: alone too little (under half
    # of their 32), together as much as one of them computes, so they wait (a burst's rule)
    assert [o.num_cached_tokens for o in on] == [0, 64, 80, 80]
    for p, a, b in zip(ENDINGS, on, off):
        assert a.output_token_ids == b.output_token_ids == hc.hf_greedy(ckpt_hv2, p, 6)


def test_burst_at_tp2_gives_transformers_tokens(ckpt_hv2):
    """Across two ranks: the held requests' snapshots are restored on every rank."""
    with LLM(ckpt_hv2, dtype="float32", prefix_snapshot_interval=32, tensor_parallel_size=2) as llm:
        on = llm.generate(prompt_token_ids=ENDINGS[:2], sampling_params=GREEDY)
        _all_free(llm)
    assert [o.num_cached_tokens for o in on] == [0, 64]
    for p, a in zip(ENDINGS, on):
        assert a.output_token_ids == hc.hf_greedy(ckpt_hv2, p, 6)


def test_mtp_burst_gives_the_same_tokens(ckpt_mtp, mtp_prompts):
    """With MTP drafting (k = 2): the others resume at the first one's grid snapshot (its hidden
    state at 31 kept with it) and give the cache-off run's and transformers' tokens."""
    args = dict(dtype="float32", speculative_method="mtp", num_speculative_tokens=2, kv_cache_memory="64MiB")
    prompts = [mtp_prompts[2] + _rand(8, 50 + i) for i in range(3)]  # 40 shared: the grid point 32
    with LLM(ckpt_mtp, enable_prefix_caching=False, **args) as llm:
        off = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    with LLM(ckpt_mtp, prefix_snapshot_interval=32, **args) as llm:
        on = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        assert llm.engine.scheduler.num_draft_tokens > 0
        _all_free(llm)
    assert [o.num_cached_tokens for o in on] == [0, 32, 32]
    for p, a, b in zip(prompts, on, off):
        assert a.output_token_ids == b.output_token_ids == hc.hf_greedy(ckpt_mtp, p, 6)


def test_prompt_logprob_burst_resumes_with_the_same_entries(ckpt_hv2):
    """Multiple choice sent at once (one context, four endings, prompt logprobs): the first computes
    the context, two more wait for its snapshot and take its kept entries; one asking for more
    alternatives than the sharer computes cannot use its snapshot, so it is not held. Every entry
    equals the cache-off run's, and the resumed ones transformers'."""
    from tests.engine.test_sampling_options import _check_logprobs, _prompt_entries

    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=2)
    wide = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=5)
    params = [sp, sp, sp, wide]
    with LLM(ckpt_hv2, dtype="float32", enable_prefix_caching=False) as llm:
        off = llm.generate(prompt_token_ids=ENDINGS, sampling_params=params)
    with LLM(ckpt_hv2, dtype="float32", prefix_snapshot_interval=32) as llm:
        on = llm.generate(prompt_token_ids=ENDINGS, sampling_params=params)
        assert llm.engine.prefix.stats.held == 2
        _all_free(llm)
    assert [o.num_cached_tokens for o in on] == [0, 64, 64, 0]
    for a, b, p in zip(on, off, params):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(ENDINGS[0])
        rows = zip(_prompt_entries(a, p.prompt_logprobs), _prompt_entries(b, p.prompt_logprobs))
        for pos, ((ta, la, topa), (tb, lb, topb)) in enumerate(rows):
            assert ta == tb and [i for i, _ in topa] == [i for i, _ in topb], f"position {pos}"
            assert la == pytest.approx(lb, abs=1e-4) and [v for _, v in topa] == pytest.approx(
                [v for _, v in topb], abs=1e-4
            ), f"position {pos}"
    _check_logprobs(ckpt_hv2, ENDINGS[1], on[1], 2, 1)


def test_held_request_whose_sharer_is_aborted_completes(ckpt_hv2):
    """The sharer is aborted after the step that held the other: the held request is admitted at the
    next step, from the snapshot the sharer committed (its pages now cached on the free list), and
    gives transformers' tokens; nothing is left held."""
    with LLM(ckpt_hv2, dtype="float32", prefix_snapshot_interval=32) as llm:
        e = llm.engine
        a = e.add_request(ENDINGS[0], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
        b = e.add_request(ENDINGS[1], GREEDY)
        e.step()
        rb = e.requests[b]
        assert rb.status is Status.WAITING and rb.held_back and e.requests[a].status is Status.RUNNING
        e.abort(a)
        outs = {}
        while e.has_unfinished():
            outs.update({o.request_id: o for o in e.step() if o.finished})
        _all_free(llm)
    assert outs[b].num_cached_tokens == 64
    assert outs[b].output_token_ids == hc.hf_greedy(ckpt_hv2, ENDINGS[1], 6)


# ---- scheduler rules, with a stand-in for the model (every sampling row gets token 7) -------------
def _sched(budget=256):
    blocks = BlockManager(64, 4)
    prefix = PrefixCache(blocks, 16, interval=8)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget)
    return Scheduler(cfg, blocks, SlotPool(8), 1000, prefix=prefix)


def _req(rid, prompt):
    return Request(rid, list(prompt), SamplingParams(max_tokens=2, ignore_eos=True))


def _step(sched):
    out = sched.schedule()
    sched.update(out, {r.request.request_id: [7] for r in out.rows if r.samples}, ())
    sched.end_final(sched.take_final(), ran=True)
    return [r.request.request_id for r in out.rows]


def _drain(sched):
    while sched.has_unfinished():
        _step(sched)
    b = sched.blocks
    assert b.num_free == b.num_blocks and not b.ref and sched.slots.num_free == sched.slots.num_slots


BASE = list(range(100, 140))


@pytest.mark.parametrize(
    "prompts, held",
    [
        # 6 shared tokens: under one interval of 8
        ([BASE[:6] + [1] * 4, BASE[:6] + [2] * 4], False),
        # 8 shared (one interval), but 24 tokens of its own: the gain is under half
        ([BASE[:8] + [1] * 24, BASE[:8] + [2] * 24], False),
        # 16 shared of 20: held
        ([BASE[:16] + [1] * 4, BASE[:16] + [2] * 4], True),
    ],
    ids=["short", "small-part", "long"],
)
def test_only_a_shared_part_that_pays_holds(prompts, held):
    sched = _sched()
    reqs = [_req(str(i), p) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add(r)
    assert _step(sched) == (["0"] if held else ["0", "1"])
    assert reqs[1].held_back is held and sched.prefix.stats.held == int(held)
    _step(sched)
    assert reqs[1].num_cached_tokens == (16 if held else 0)
    _drain(sched)


def test_a_burst_waits_for_a_part_too_small_for_one():
    """The second case above with four waiting: each skips 8 of its 32 tokens by waiting (under
    half), but together 32, what one of them computes if admitted now: all four wait a step and
    resume at 8. With three waiting (24 together) none waits."""
    for waiting, held in ((4, True), (3, False)):
        sched = _sched()
        reqs = [_req(str(i), BASE[:8] + [i + 1] * 24) for i in range(1 + waiting)]
        for r in reqs:
            sched.add(r)
        assert _step(sched) == (["0"] if held else [r.request_id for r in reqs])
        assert all(r.held_back is held for r in reqs[1:]) and sched.prefix.stats.held == (waiting if held else 0)
        _step(sched)
        assert [r.num_cached_tokens for r in reqs] == [0] + [8 if held else 0] * waiting
        _drain(sched)


def test_held_request_does_not_block_those_behind_it():
    sched = _sched()
    a, b, c = _req("a", BASE[:16] + [1] * 4), _req("b", BASE[:16] + [2] * 4), _req("c", [5] * 12)
    for r in (a, b, c):
        sched.add(r)
    assert _step(sched) == ["a", "c"]
    assert list(sched.waiting) == [b] and b.held_back
    _step(sched)
    assert b.status is Status.RUNNING and b.num_cached_tokens == 16
    _drain(sched)


def test_sharer_gone_before_its_snapshot_releases_the_hold():
    """The step that would save the sharer's snapshots fails and the sharer is aborted: the held
    request goes back to normal admission (no hit) and completes; every page and slot is back."""
    sched = _sched()
    a, b = _req("a", BASE[:16] + [1] * 4), _req("b", BASE[:16] + [2] * 4)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [r.request for r in out.rows] == [a] and b.held_back
    sched.abandon(out)
    sched.finish(a, "abort")
    assert _step(sched) == ["b"] and b.num_cached_tokens == 0
    _drain(sched)
    assert b.status is Status.FINISHED and b.output_token_ids == [7, 7]

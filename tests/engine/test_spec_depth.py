"""The draft-depth policy (engine/scheduler/spec_depth.py) as pure functions of a `SpecDepth`:
values worked out by hand from the rules in its docstring, the input never changed, and the
depths a row announces ahead equal to what the scheduler then records."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, replace

import pytest

from engine.cache.block_manager import BlockManager, SlotPool
from engine.config import SchedulerConfig, SpeculativeConfig
from engine.request import Request, SpecDepth
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler.spec_depth import after_plain, after_verify, depths_after, max_depth, started

CFG = SpeculativeConfig(
    num_tokens=3, depth_lower=0.3, depth_raise=0.6, depth_ema=0.5, draft_cost=0.5, probe_interval=2, probe_max=8
)


def D(
    depth: int = 0,
    acceptance: float = 1.0,
    first: float = 1.0,
    probing: bool = False,
    gap: int = 0,
    wait: int = 0,
    cap: int = 3,
) -> SpecDepth:
    """A SpecDepth of a request that may carry 3 drafts unless told otherwise."""
    return SpecDepth(depth, acceptance, first, probing, gap, wait, cap)


def test_after_verify_by_hand():
    s = D(depth=3)
    half = after_verify(s, CFG, 2, 1)  # a = 0.5 * 1 + 0.5 * 0.5, first = 0.5 * 1 + 0.5 * 1
    assert half == D(depth=3, acceptance=0.75, first=1.0)
    none = after_verify(s, CFG, 3, 0)  # first 0.5: not under draft_cost; a 0.5: no change
    assert none == D(depth=3, acceptance=0.5, first=0.5)
    # first 0.25 < 0.5: depth 0 from any depth, the first wait is the interval
    assert after_verify(none, CFG, 3, 0) == D(0, 0.25, 0.25, False, 2, 2)
    # a 0.25 < 0.3 with the first draft accepted often enough: one down, but not below 1
    low = D(depth=2, acceptance=0.2, first=1.0)
    assert after_verify(low, CFG, 3, 1).depth == 1
    assert after_verify(replace(low, depth=1), CFG, 1, 0).depth == 1
    # high acceptance climbs to the cap, not past it
    assert after_verify(D(depth=1), CFG, 1, 1).depth == 2
    assert after_verify(D(depth=2, cap=2), CFG, 2, 2).depth == 2
    assert s == D(depth=3)  # the input is unchanged


def test_probe_outcomes_by_hand():
    probe = D(depth=1, acceptance=0.1, first=0.1, probing=True, gap=4, wait=0)
    # the probe alone counts (weight 1): failed -> depth 0, the wait doubled
    assert after_verify(probe, CFG, 1, 0) == D(0, 0.0, 0.0, False, 8, 8)
    assert after_verify(replace(probe, gap=8), CFG, 1, 0).gap == 8  # capped at probe_max
    # passed: depth 1, no climb on the probe itself
    assert after_verify(probe, CFG, 1, 1) == D(1, 1.0, 1.0, False, 4, 0)


def test_after_plain_counts_down_to_a_probe():
    s = D(depth=0, gap=2, wait=2)
    s1 = after_plain(s)
    assert s1 == D(depth=0, gap=2, wait=1)
    assert after_plain(s1) == D(depth=1, probing=True, gap=2, wait=0)
    assert after_plain(replace(s, cap=0)) == replace(s, cap=0)  # may not draft: never probes
    assert after_plain(D(depth=2)) == D(depth=2)  # drafting: nothing to count
    with pytest.raises(FrozenInstanceError):
        s.depth = 1  # type: ignore[misc]


def test_max_depth_and_the_starting_record():
    assert max_depth(SamplingParams(), 3) == 3
    assert max_depth(SamplingParams(num_speculative_tokens=1), 3) == 1
    assert max_depth(SamplingParams(num_speculative_tokens=0), 3) == 0
    assert max_depth(SamplingParams(logprobs=1, presence_penalty=1.5), 3) == 3  # verified at every position
    assert started(SpecDepth(), SamplingParams(num_speculative_tokens=2), 3) == SpecDepth(depth=2, cap=2)


def test_depths_announced_ahead_match_the_recorded_depth():
    """`ScheduledRow.draft_depths[a]` is the depth the scheduler records after `a` accepted."""
    cfg = replace(CFG, method="mtp")
    sched = Scheduler(SchedulerConfig(), BlockManager(8, 16), SlotPool(2), 128, 3, None, cfg)
    for state in [D(depth=3), D(2, 0.2, 0.6), D(1, 0.1, 0.1, True, 4, 0)]:
        ahead = depths_after(state, cfg, state.depth)
        for a in range(state.depth + 1):
            r = Request("r", [1, 2, 3], SamplingParams())
            r.spec = state
            sched._record(r, state.depth, a)
            assert r.spec.depth == ahead[a]
    r = Request("r", [1], SamplingParams())
    r.spec = D(depth=0, gap=2, wait=1)
    assert depths_after(r.spec, cfg, 0) == (1,)
    sched._tick(r)
    assert r.spec.depth == 1


def test_depths_ahead_equal_the_records_depths():
    """depths_after (what the MTP drafter reads ahead, computed without building records) gives the
    depth of the record after_plain / after_verify would build, over a grid of states."""
    states = [
        D(depth=d, acceptance=a, first=f, probing=p, gap=g, wait=w, cap=c)
        for d in (0, 1, 3)
        for a in (0.1, 0.5, 0.9)
        for f in (0.2, 0.8)
        for p in (False, True)
        for g, w in ((2, 0), (2, 1), (4, 3))
        for c in (0, 3)
    ]
    for s in states:
        assert depths_after(s, CFG, 0) == (after_plain(s).depth,), s
        for k in (1, 2, 3):
            assert depths_after(s, CFG, k) == tuple(after_verify(s, CFG, k, a).depth for a in range(k + 1)), s

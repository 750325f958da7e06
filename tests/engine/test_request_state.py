"""A request's states and moves (engine/request_state.py): the table against the moves written
out here by hand, every allowed move made by the real scheduler (a stand-in model samples token
7), every other move refused with the state unchanged, and the memory back after each path."""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine.cache.block_manager import BlockManager, SlotPool
from engine.cache.prefix import PrefixCache
from engine.config import SchedulerConfig
from engine.request import Request, Status, TransitionError
from engine.request_state import TRANSITIONS
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

W, R, P, H, V, F, A = (
    Status.WAITING,
    Status.RUNNING,
    Status.PREEMPTED,
    Status.HELD,
    Status.RESERVED,
    Status.FINISHED,
    Status.ABORTED,
)

# What the engine does, one line per move (the reference the table is checked against)
EXPECTED = {
    (W, R): "admitted",
    (W, V): "decode side: memory reserved for a state another node sends",
    (W, A): "aborted while queued",
    (R, P): "preempted for pages",
    (R, H): "prefill side: prompt done, memory kept for the push",
    (R, F): "stop token, EOS, max_tokens, max_model_len or a context that fills the cache",
    (R, A): "aborted while running",
    (P, R): "admitted again, recomputing",
    (P, A): "aborted while queued again",
    (H, F): "the push read the memory",
    (H, A): "aborted while held",
    (V, R): "the state landed: activated",
    (V, A): "the transfer was abandoned",
}


@dataclass
class Traced(Request):
    """A request that records every move it makes."""

    moves: list[tuple[Status, Status]] = field(default_factory=list)

    def move(self, to: Status) -> None:
        src = self.status
        super().move(to)
        self.moves.append((src, to))


def make(num_blocks: int = 16, prefix: bool = True) -> tuple[Scheduler, BlockManager, SlotPool]:
    blocks, slots = BlockManager(num_blocks, 4), SlotPool(2)
    pc = PrefixCache(blocks, 4, interval=4) if prefix else None
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    return Scheduler(cfg, blocks, slots, 1000, prefix=pc), blocks, slots


def req(rid: str, n: int = 6, max_tokens: int = 3, prefill_only: bool = False) -> Traced:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Traced(rid, list(range(1, n + 1)), params, prefill_only=prefill_only)


def step(s: Scheduler) -> None:
    out = s.schedule()
    s.update(out, {r.request.request_id: [7] for r in out.rows if r.samples}, ())
    s.end_final(s.take_final(), ran=True)


def run(s: Scheduler, r: Request) -> None:
    while not r.status.is_final and r.status is not Status.HELD:
        step(s)


# Each path drives the scheduler as the engine does and names the moves it must make.
def finished(s: Scheduler) -> Traced:
    r = req("a")
    s.add(r)
    run(s, r)
    return r


def aborted_queued(s: Scheduler) -> Traced:
    r = req("a")
    s.add(r)
    s.finish(r, "abort")
    return r


def aborted_running(s: Scheduler) -> Traced:
    r = req("a")
    s.add(r)
    step(s)
    s.finish(r, "abort")
    return r


def preempted_then_finished(s: Scheduler) -> Traced:
    r = req("a")
    s.add(r)
    step(s)
    s._preempt(r)
    run(s, r)
    return r


def preempted_then_aborted(s: Scheduler) -> Traced:
    r = req("a")
    s.add(r)
    step(s)
    s._preempt(r)
    s.finish(r, "abort")
    return r


def outgrows_the_cache(s: Scheduler) -> Traced:
    r = req("a", n=8, max_tokens=20)  # 3 pages of 4 hold the KV of 12 tokens
    s.add(r)
    run(s, r)
    # 8 + 5 tokens: the 13th was sampled, and computing it needs a 4th page
    assert r.finish_reason == "length" and len(r.output_token_ids) == 5
    return r


def held_then_pushed(s: Scheduler) -> Traced:
    r = req("a", prefill_only=True)
    s.add(r)
    run(s, r)
    assert r.finish_reason == "prefilled" and r.output_token_ids == [7]
    s.finish(r, "prefilled")
    return r


def held_then_aborted(s: Scheduler) -> Traced:
    r = req("a", prefill_only=True)
    s.add(r)
    run(s, r)
    s.finish(r, "abort")
    return r


def reserved_then_activated(s: Scheduler) -> Traced:
    r = req("a")
    assert s.reserve(r)
    s.activate(r, 7, ())
    run(s, r)
    return r


def reserved_then_abandoned(s: Scheduler) -> Traced:
    r = req("a")
    assert s.reserve(r)
    s.finish(r, "abort")
    return r


PATHS: list[tuple[Callable[[Scheduler], Traced], int, list[tuple[Status, Status]]]] = [
    (finished, 16, [(W, R), (R, F)]),
    (aborted_queued, 16, [(W, A)]),
    (aborted_running, 16, [(W, R), (R, A)]),
    (preempted_then_finished, 16, [(W, R), (R, P), (P, R), (R, F)]),
    (preempted_then_aborted, 16, [(W, R), (R, P), (P, A)]),
    (outgrows_the_cache, 3, [(W, R), (R, F)]),
    (held_then_pushed, 16, [(W, R), (R, H), (H, F)]),
    (held_then_aborted, 16, [(W, R), (R, H), (H, A)]),
    (reserved_then_activated, 16, [(W, V), (V, R), (R, F)]),
    (reserved_then_abandoned, 16, [(W, V), (V, A)]),
]


def test_table_is_the_expected_moves():
    table = {(a, b) for a, to in TRANSITIONS.items() for b in to}
    assert table == set(EXPECTED)
    assert set(TRANSITIONS) == set(Status)
    assert {s for s in Status if not TRANSITIONS[s]} == {F, A} == {s for s in Status if s.is_final}


@pytest.mark.parametrize("prefix", [True, False], ids=["prefix-cache", "no-prefix-cache"])
@pytest.mark.parametrize("path,num_blocks,moves", PATHS, ids=[p[0].__name__ for p in PATHS])
def test_scheduler_makes_each_allowed_move(path, num_blocks, moves, prefix):
    s, blocks, slots = make(num_blocks, prefix)
    r = path(s)
    assert r.moves == moves
    assert r.status is moves[-1][1] and r.status.is_final
    assert not s.running and not s.waiting and slots.num_free == 2
    assert blocks.num_free == num_blocks and not blocks.ref


def test_paths_cover_the_table():
    assert {m for _, _, moves in PATHS for m in moves} == set(EXPECTED)


def _reach(target: Status) -> Request:
    """A request brought to `target` through allowed moves only (breadth first from WAITING)."""
    prev: dict[Status, Status | None] = {W: None}
    todo = deque([W])
    while todo:
        a = todo.popleft()
        for b in TRANSITIONS[a]:
            if b not in prev:
                prev[b] = a
                todo.append(b)
    path: list[Status] = []
    at: Status | None = target
    while at is not None and at is not W:
        path.append(at)
        at = prev[at]
    r = Request("r", [1], SamplingParams())
    for st in reversed(path):
        r.move(st)
    assert r.status is target
    return r


@pytest.mark.parametrize("src", list(Status), ids=[s.value for s in Status])
def test_every_other_move_raises_and_leaves_the_state(src):
    for dst in Status:
        r = _reach(src)
        if (src, dst) in EXPECTED:
            r.move(dst)
            assert r.status is dst
            continue
        with pytest.raises(TransitionError, match=f"{src.value} -> {dst.value} is not allowed"):
            r.move(dst)
        assert r.status is src


def test_status_is_changed_only_by_move():
    r = Request("r", [1], SamplingParams())
    with pytest.raises(AttributeError):
        r.status = Status.RUNNING  # type: ignore[misc]
    assert r.status is W


def test_no_code_but_request_move_writes_a_state():
    """Outside Request.move nothing assigns a request's status (the table would be bypassed)."""
    root = Path(__file__).resolve().parents[2]
    writes = re.compile(r"\.(_status|status)\s*=[^=]")
    found = [
        f"{path.relative_to(root)}: {line.strip()}"
        for pkg in ("engine", "prefill_node", "decode_node", "serving", "transfer")
        for path in sorted((root / pkg).rglob("*.py"))
        for line in path.read_text().splitlines()
        if writes.search(line)
    ]
    assert found == ["engine/request.py: self._status = to"], found


def test_activate_needs_a_reservation():
    s, blocks, _ = make()
    r = req("a")
    s.add(r)
    step(s)
    with pytest.raises(TransitionError, match="only a reserved one activates"):
        s.activate(r, 7, ())
    assert r.status is R and r.output_token_ids == [7]

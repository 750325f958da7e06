"""The shared buffer that carries step inputs to tensor-parallel ranks (engine/step_channel.py):
a step read back in another process equals the one written, field for field; a step over the
buffer's size comes back pickled (the executor sends it down the pipes); the buffer's file goes at
close. Rows' page lists and ids travel as what they gained (engine/step_lists.py): over a run of
steps that grow, replace, truncate, drop and add rows' lists, with steps of no rows and steps
over the buffer between them, every step read equals a copy of the step taken when it was written,
the engine's rows keep their own lists and parameters, and a growing step sends its tails only."""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import pickle
import random

import pytest

from engine.sampling_params import SamplingParams
from engine.step import RowInput, SnapshotCopy, StepInput
from engine.step_channel import StepReader, StepWriter


def _step(n: int) -> StepInput:
    rows = [
        RowInput(
            f"r{b}",
            [b + 1, b + 2],
            30 + b,
            b,
            list(range(b, b + 4)),
            True,
            True,
            params=SamplingParams(temperature=0.7, top_p=0.8, seed=b),
            history=(list(range(30)), [b]),
            num_output=1,
        )
        for b in range(n)
    ]
    return StepInput(rows, ["gone"], [SnapshotCopy(1, 2, 3)], [SnapshotCopy(4, 5, None, 7)])


def _read_in_child(path: str, n: int, out) -> None:
    r = StepReader(path)
    out.send(r.read(n))
    r.close()


def test_a_step_read_in_another_process_equals_the_one_written():
    w = StepWriter()
    try:
        for batch in (1, 64):
            step = _step(batch)
            n = w.write(step)
            assert n is not None
            parent, child = mp.get_context("spawn").Pipe()
            p = mp.get_context("spawn").Process(target=_read_in_child, args=(w.path, n, child))
            p.start()
            got = parent.recv()
            p.join(30)
            assert got == step
    finally:
        w.close()
    assert not os.path.exists(w.path)


def test_a_step_over_the_buffer_comes_back_pickled():
    w = StepWriter(size=4096)
    r = StepReader(w.path)
    try:
        assert isinstance(w.write(_step(1)), int)
        big = _step(200)
        blob = w.write(big)
        assert isinstance(blob, bytes)
        assert r.read(blob) == big
    finally:
        r.close()
        w.close()
        w.close()  # idempotent


class _Req:
    """What the scheduler keeps of a request: lists it appends to and replaces."""

    def __init__(self, rid: str, prompt_len: int, rng: random.Random):
        self.rid, self.rng = rid, rng
        self.prompt = [rng.randrange(1000) for _ in range(prompt_len)]
        self.output: list[int] = []
        self.pages = list(range(prompt_len // 4 + 1))
        self.params = {  # the request's own, sent once (then `Kept`)
            pen: SamplingParams(temperature=0.7, presence_penalty=1.5 if pen else 0.0, seed=int(rid[1:]))
            for pen in (False, True)
        }

    def row(self, penalized: bool) -> RowInput:
        return RowInput(
            self.rid,
            [self.output[-1] if self.output else self.prompt[-1]],
            len(self.prompt) + len(self.output),
            int(self.rid[1:]),
            self.pages,
            True,
            True,
            params=self.params[penalized],
            history=(self.prompt, self.output) if penalized else None,
            num_output=len(self.output),
        )


def test_rows_lists_travel_as_what_they_gained():
    rng = random.Random(0)
    reqs = {f"r{i}": _Req(f"r{i}", rng.randrange(8, 3000), rng) for i in range(12)}
    w = StepWriter(size=64 << 10)
    r = StepReader(w.path)
    sizes, whole = [], 0  # (sent, the step pickled as it is) bytes; steps sent pickled
    try:
        live = set(list(reqs)[:8])
        for step_no in range(120):
            for rid in live:  # the step before ran: a token each, a page now and then
                q = reqs[rid]
                q.output.append(rng.randrange(1000))
                if rng.random() < 0.25:
                    q.pages += [rng.randrange(10_000)]
            event = rng.random()
            if event < 0.05:  # preempted and admitted again: a new page list
                q = reqs[rng.choice(sorted(live))]
                q.pages = list(range(500, 500 + len(q.pages)))
            elif event < 0.08:  # pages given back at the end of the list, in place
                q = reqs[rng.choice(sorted(live))]
                del q.pages[max(1, len(q.pages) - 2) :]
            elif event < 0.12:  # one leaves, another joins
                live.discard(rng.choice(sorted(live)))
                live.add(rng.choice(sorted(set(reqs) - live)))
            rows = [reqs[rid].row(penalized=rid < "r6") for rid in sorted(live)]
            if step_no % 17 == 5:  # a step of snapshot copies alone between two steps
                msg = w.write(StepInput([], [], [], [SnapshotCopy(1, 2, 3)]))
                assert r.read(msg).rows == []
            if step_no == 60:  # one request's prompt grows past the buffer: that step goes whole
                reqs[rows[0].request_id].prompt += list(range(40_000))
                rows = [reqs[rid].row(penalized=rid < "r6") for rid in sorted(live)]
            step = StepInput(rows, [])
            want = copy.deepcopy(step)
            own = [(row.block_ids, row.history, row.params) for row in rows]
            msg = w.write(step)
            whole += isinstance(msg, bytes)
            sizes.append((msg if isinstance(msg, int) else len(msg), len(pickle.dumps(want))))
            assert r.read(msg) == want, step_no
            assert all(row.block_ids is b and row.history is h and row.params is p for row, (b, h, p) in zip(rows, own))
    finally:
        r.close()
        w.close()
    assert whole == 1
    # rows of hundreds of pages and thousands of ids: whole in the first step, then their tails
    assert sizes[0][0] > sizes[0][1] * 0.9, sizes[0]
    assert all(sent * 4 < as_is for sent, as_is in sizes[70:]), sizes[70:]


def test_a_step_that_fails_to_pickle_leaves_the_lists_in_step():
    """What a failed write meant to send is not taken as sent: the next step's tails are relative
    to the last step the rank read, and the engine's rows keep their own lists."""
    rng = random.Random(1)
    q = _Req("r0", 50, rng)
    w = StepWriter()
    r = StepReader(w.path)
    try:
        q.output.append(1)
        first = StepInput([q.row(penalized=True)], [])
        assert r.read(w.write(first)) == copy.deepcopy(first)
        q.output.append(2)
        q.pages.append(99)
        bad = q.row(penalized=True)
        bad.mrope = [[lambda: 0]]  # not picklable
        with pytest.raises((pickle.PicklingError, AttributeError)):
            w.write(StepInput([bad], []))
        assert bad.block_ids is q.pages and bad.history == (q.prompt, q.output)
        q.output.append(3)
        q.pages.append(100)
        after = StepInput([q.row(penalized=True)], [])
        assert r.read(w.write(after)) == copy.deepcopy(after)
    finally:
        r.close()
        w.close()


def test_steady_steps_travel_as_what_moved():
    """Steady steps (the same rows, moved on in place as engine/step_input.py advance does) travel
    as each row's token, position and output count plus its lists' tails; the rank moves the rows
    it kept. Every step read equals a copy of the step written, across steady runs broken by a
    changed batch, a row-less step and a page opened in place, and a steady step is a fraction of
    the step pickled."""
    rng = random.Random(2)
    reqs = [_Req(f"r{i}", rng.randrange(8, 300), rng) for i in range(6)]
    w = StepWriter()
    r = StepReader(w.path)
    small = []
    try:
        rows: list[RowInput] = []
        for step_no in range(80):
            for q in reqs:
                q.output.append(rng.randrange(1000))
                if rng.random() < 0.2:
                    q.pages.append(rng.randrange(10_000))
            steady = bool(rows) and step_no % 20 != 0
            if steady:  # advance: three fields a row, in place
                for row, q in zip(rows, reqs):
                    row.token_ids = [q.output[-1]]
                    row.start_pos += 1
                    row.num_output = len(q.output)
            else:  # a changed batch: rows built afresh
                rows = [q.row(penalized=i % 2 == 0) for i, q in enumerate(reqs)]
            if step_no == 50:  # said steady, but rows the rank has not got (another list, another order)
                rows = [q.row(penalized=i % 2 == 0) for i, q in enumerate(reqs)][::-1]
                reqs = reqs[::-1]
            if step_no % 13 == 7:  # snapshot copies alone between two steady steps
                assert r.read(w.write(StepInput([], [], [], [SnapshotCopy(1, 2, 3)]))).rows == []
            step = StepInput(rows, ["gone"] if step_no % 7 == 0 else [], plain=True, steady=steady)
            want = copy.deepcopy(step)
            msg = w.write(step)
            assert isinstance(msg, int)
            got = r.read(msg)
            assert got == want, step_no
            if steady and step_no != 50:
                small.append((msg, len(pickle.dumps(want))))
    finally:
        r.close()
        w.close()
    assert len(small) >= 58
    assert all(sent * 3 < as_is for sent, as_is in small), small

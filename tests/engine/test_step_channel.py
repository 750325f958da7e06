"""The shared buffer that carries step inputs to tensor-parallel ranks (engine/step_channel.py):
a step read back in another process equals the one written, field for field; a step over the
buffer's size is refused (the executor then sends it whole); the buffer's file goes at close."""

from __future__ import annotations

import multiprocessing as mp
import os

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


def test_a_step_over_the_buffer_is_refused():
    w = StepWriter(size=4096)
    try:
        assert w.write(_step(1)) is not None
        assert w.write(_step(200)) is None
    finally:
        w.close()
        w.close()  # idempotent

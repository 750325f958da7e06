"""engine/step_input.py: a plain decode row's short path builds the row the general path builds.
With MTP on, the same row takes the general path (a row without drafts gets no draft depths and
no known next token there), so the two are compared field by field over sampling settings that
do and do not need the request's ids."""

from __future__ import annotations

import pytest

from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler.output import ScheduledRow, SchedulerOutput
from engine.step_input import step_input

CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "qwen chat": SamplingParams(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5, seed=3),
    "min_tokens": SamplingParams(min_tokens=10),
    "logit_bias": SamplingParams(logit_bias={5: 1.0}),
}


@pytest.mark.parametrize("params", CASES.values(), ids=CASES.keys())
def test_short_path_builds_the_general_rows(params):
    req = Request("r", list(range(40)), params, output_token_ids=[7, 8, 9], slot=3, block_ids=[4, 9, 2])
    req.num_computed_tokens = 42  # the last output token is pending
    req.rope_delta = 2
    row = ScheduledRow(req, 1)
    assert row.is_decode and row.samples
    so = SchedulerOutput([row], [], [])
    short = step_input(so, mtp=False, merge=0, layer_posts=[]).rows[0]
    general = step_input(so, mtp=True, merge=0, layer_posts=[]).rows[0]
    assert short == general
    assert short.token_ids == [9] and short.start_pos == 42 and short.block_ids == [4, 9, 2]
    assert short.block_ids is not req.block_ids  # a copy: the scheduler grows the request's list

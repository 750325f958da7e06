"""engine/step_input.py: a decode row's short path builds the row the general path
(`general_row`) builds, field by field, over sampling settings that do and do not need the
request's ids, without and with drafts, with MTP's draft depths."""

from __future__ import annotations

import pytest

from engine.model.graphs import plain_decode
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler.output import ScheduledRow, SchedulerOutput
from engine.step_input import general_row, step_input

CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "qwen chat": SamplingParams(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5, seed=3),
    "min_tokens": SamplingParams(min_tokens=10),
    "logit_bias": SamplingParams(logit_bias={5: 1.0}),
}


@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
@pytest.mark.parametrize("drafts", [[], [11, 12]], ids=["no-drafts", "drafts"])
@pytest.mark.parametrize("params", CASES.values(), ids=CASES.keys())
def test_short_path_builds_the_general_rows(params, drafts, mtp):
    req = Request("r", list(range(40)), params, output_token_ids=[7, 8, 9], slot=3, block_ids=[4, 9, 2])
    req.num_computed_tokens = 42  # the last output token is pending
    req.rope_delta = 2
    row = ScheduledRow(req, 1 + len(drafts), list(drafts), (1, 2, 2) if drafts else (2,))
    assert row.is_decode and row.samples
    short = step_input(SchedulerOutput([row], [], []), mtp=mtp, merge=0, layer_posts=[]).rows[0]
    assert short == general_row(row, mtp, 0)
    assert short.token_ids == [9, *drafts] and short.num_draft == len(drafts) and short.start_pos == 42
    assert short.draft_depths == (row.draft_depths if mtp else ()) and short.next_token is None
    # the request's own list, not an O(context) copy: the scheduler grows it only between steps
    assert short.block_ids is req.block_ids and short.block_ids == [4, 9, 2]


def _decode_row(rid: str, rope_delta: int = 0, want_logits: bool = False) -> ScheduledRow:
    req = Request(rid, list(range(40)), SamplingParams(temperature=0.0), output_token_ids=[7], slot=1, block_ids=[4])
    req.num_computed_tokens = 40
    req.rope_delta = rope_delta
    req.want_logits = want_logits
    return ScheduledRow(req, 1)


def test_a_step_of_plain_decode_rows_says_so_and_agrees_with_the_check():
    """StepInput.plain, set where the rows are built, is true only where engine/model/graphs.py
    plain_decode, row by row, is true too: every row a plain decode row."""
    cases = {  # rows, plain_decode, StepInput.plain
        "decode rows": ([_decode_row("a"), _decode_row("b")], True, True),
        "a rotary offset": ([_decode_row("a"), _decode_row("b", rope_delta=3)], False, False),
        "wanted logits": ([_decode_row("a", want_logits=True)], True, False),  # built the general way
        "no rows": ([], True, False),  # the worker returns before building a batch
    }
    for name, (rows, checked, said) in cases.items():
        step = step_input(SchedulerOutput(rows, [], []), mtp=False, merge=0, layer_posts=[])
        assert plain_decode(step.rows) == checked, name
        assert step.plain == said, name
    # MTP, or a row with drafts: not plain (the graphs and the persistent batch leave them)
    assert not step_input(SchedulerOutput([_decode_row("a")], [], []), mtp=True, merge=0, layer_posts=[]).plain
    drafted = _decode_row("d")
    drafted = ScheduledRow(drafted.request, 3, [5, 6])
    step = step_input(SchedulerOutput([_decode_row("a"), drafted], [], []), mtp=False, merge=0, layer_posts=[])
    assert not step.plain and not plain_decode(step.rows)
    prompt = Request("p", list(range(40)), SamplingParams(), slot=2, block_ids=[5, 6, 7])
    step = step_input(SchedulerOutput([_decode_row("a"), ScheduledRow(prompt, 40)], [], []), False, 0, [])
    assert not step.plain and not plain_decode(step.rows)

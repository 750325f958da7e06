"""A request's token spans (engine/request.py `token_ids`, `hash_ids`) against slicing the joined
prompt and output: every (start, end) of short lists, and the hash view of an image prompt."""

from __future__ import annotations

import itertools

from engine.request import Request
from engine.sampling_params import SamplingParams


def test_spans_equal_slices_of_the_joined_lists():
    for p_len, o_len in itertools.product(range(4), range(4)):
        req = Request("r", list(range(10, 10 + p_len)), SamplingParams())
        req.output_token_ids.extend(range(50, 50 + o_len))
        joined = req.prompt_token_ids + req.output_token_ids
        for start in range(p_len + o_len + 1):
            for end in range(start, p_len + o_len + 2):
                assert req.token_ids(start, end) == joined[start:end], (p_len, o_len, start, end)
                assert req.hash_ids(start, end) == joined[start:end]


def test_spans_at_the_end_of_a_long_prompt():
    req = Request("r", list(range(100_000)), SamplingParams())
    req.output_token_ids.extend([7, 8, 9])
    assert req.token_ids(100_002, 100_003) == [9]
    assert req.token_ids(99_999, 100_001) == [99_999, 7]

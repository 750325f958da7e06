"""Greedy rows of the batched sampler (on the CPU the C argmax over every token,
kernels/cpu_ops.py masked_argmax) against a naive per-row loop."""

from __future__ import annotations

import pytest
import torch

from engine.sampling import Sampler
from engine.sampling_params import SamplingParams
from engine.step import RowInput


@pytest.mark.parametrize("mixed", [False, True], ids=["all-greedy", "greedy-beside-sampled"])
def test_greedy_rows_take_the_first_largest_logit(mixed):
    """Greedy rows (on the CPU the C argmax over every token) against a naive per-row loop: the
    first id holding the row's largest value, at Qwen's vocabulary size, with ties planted inside
    and across the operator's 32-id words, and a row of -inf but one id."""
    v = 151_936
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(6, v, generator=g) * 3).to(torch.bfloat16).float()  # bfloat16 values: many ties
    x[0, [70_001, 3, 40]] = 30.0  # the first is not the lowest id written
    x[1, [31, 32]] = 30.0  # across a word's edge
    x[2] = float("-inf")
    x[2, v - 1] = 0.0
    x[3, 5] = x[3].max()  # a tie with the row's own largest, earlier
    params = [SamplingParams(temperature=0.0) for _ in range(6)]
    if mixed:
        params[4] = SamplingParams(temperature=0.8, top_k=5, seed=1)
    rows = [RowInput(f"r{b}", [7], 40, 0, [], True, True, params=p, num_output=0) for b, p in enumerate(params)]
    got = [t[0] for t in Sampler()(x.clone(), rows, list(range(6)))[0]]

    def first_largest(row: list[float]) -> int:
        best = 0
        for i, val in enumerate(row):
            if val > row[best]:
                best = i
        return best

    for b, p in enumerate(params):
        if p.greedy:
            assert got[b] == first_largest(x[b].tolist()), b

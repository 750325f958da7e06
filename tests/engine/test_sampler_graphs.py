"""The sampler's CUDA graphs (engine/sampling/sampler.py `_graphed`): a plan reused over running
rows, its device work replayed from a graph, draws the tokens the eager calls draw from the same
logits, call after call (seeded chat settings, greedy rows beside them, penalties whose counts the
graph updates, logit_bias, a min_tokens ban that ends mid-run and changes the plan). A plan with a
row the graph cannot take (top-p alone: the head check's second read) stays eager."""

from __future__ import annotations

import pytest
import torch

from engine.sampling import Sampler
from engine.sampling_params import SamplingParams
from engine.step import RowInput

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

B, V = 64, 151_936
CHAT = dict(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5)


def _params(head_row: bool) -> list[SamplingParams]:
    out = []
    for b in range(B):
        kind = b % 5
        if kind == 0:
            out.append(SamplingParams(temperature=0.0))
        elif kind == 1:
            out.append(SamplingParams(**CHAT, seed=1000 + b))
        elif kind == 2:
            out.append(SamplingParams(temperature=0.8, top_k=50, frequency_penalty=0.5, repetition_penalty=1.2, seed=b))
        elif kind == 3:
            out.append(SamplingParams(temperature=1.0, top_k=40, logit_bias={11: 5.0, 12: -100.0}, seed=b))
        else:
            out.append(SamplingParams(**CHAT, seed=b, min_tokens=4, stop_token_ids=[13, 14]))
    if head_row:
        out[-1] = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    return out


def _run(params: list[SamplingParams], static: bool, calls: int = 10) -> tuple[list[list[int]], Sampler]:
    torch.manual_seed(0)
    s = Sampler(seed=3, eos_token_ids=(15,), device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    work = torch.empty(B, V, device="cuda")  # the same address each call, as a decode graph's logits
    rows = [
        RowInput(f"r{b}", [7], 40, 0, [], True, True, params=p, history=(list(range(100, 140)), []), num_output=0)
        for b, p in enumerate(params)
    ]
    got = []
    for _ in range(calls):
        work.copy_(torch.randn(B, V, device="cuda", generator=gen) * 4)
        emitted, _ = s(work, rows, list(range(B)), static=static)
        for r, e in zip(rows, emitted):
            assert r.history is not None
            r.history[1].append(e[0])
            r.num_output += 1
            r.start_pos += 1
        got.append([e[0] for e in emitted])
    return got, s


def test_replayed_calls_draw_the_eager_tokens():
    params = _params(head_row=False)
    ref, eager = _run(params, static=False)
    got, graphed = _run(params, static=True)
    assert eager.replays == 0
    assert graphed.replays >= 5  # two plans (the min_tokens ban ends at the fifth call), each replayed
    assert got == ref


def test_a_plan_with_a_head_row_stays_eager():
    params = _params(head_row=True)
    ref, _ = _run(params, static=False, calls=5)
    got, graphed = _run(params, static=True, calls=5)
    assert graphed.replays == 0
    assert got == ref

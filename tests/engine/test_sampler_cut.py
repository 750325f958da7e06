"""Top-p / min-p rows whose kept set is found without sorting the vocabulary (engine/sampling/cut.py)
against a reference written here: the row sorted by (probability descending, id), the mass of
the tokens above each summed in float64, a token kept while its probability is at least min_p
times the largest and the mass above it below top_p times the total of those (min-p first); the draw the inverse CDF over the kept tokens in id
order at the row's seeded uniform. Vocabularies of 151,936 and 1,024, float32 and bfloat16 logits
(whose ties fall at the cut), temperatures, top_p from 0.5 to 0.999, min_p, -inf masks, equal
logits, one dominant token; and through the sampler: flat rows drawn without a sort, alone or
beside rows their head holds, the same tokens as the reference."""

from __future__ import annotations

import pytest
import torch

import engine.sampling.sampler as sm
from engine.sampling import Sampler, cut
from engine.sampling.filters import inverse_cdf
from engine.sampling.rng import as_int64, seeded_uniforms
from engine.sampling_params import SamplingParams
from engine.step import RowInput

QWEN_VOCAB = 151_936
_sort = torch.sort  # the reference's, out of reach of the test that forbids the sampler one


def _reference(x: torch.Tensor, t, top_p, min_p) -> torch.Tensor:
    """The kept probabilities [N, V] in id order (0 elsewhere), row by row from the sorted row."""
    t, top_p, min_p = (torch.as_tensor(v, dtype=torch.float32).expand(x.shape[0]) for v in (t, top_p, min_p))
    out = torch.zeros_like(x)
    for r in range(x.shape[0]):
        p = torch.softmax(x[r] / t[r], -1)
        ps, order = _sort(p, descending=True, stable=True)  # ties keep id order
        keep = ps >= min_p[r] * ps[0]  # min-p first (vLLM's order), then top-p over what it keeps
        total = float(ps[keep].double().sum()) if min_p[r] > 0 else 1.0  # min_p 0: the softmax's own 1
        mass_above = ps.double().cumsum(0) - ps.double()
        keep &= (mass_above < float(top_p[r]) * total) | bool(top_p[r] >= 1.0)
        out[r, order[keep]] = ps[keep]
    return out


def _uniforms(seeds: list[int], counters: list[int]) -> torch.Tensor:
    return seeded_uniforms(torch.tensor([as_int64(s) for s in seeds]), torch.tensor(counters))


def _rows_of(n: int, g: torch.Generator, vocab: int, bf16: bool) -> tuple[torch.Tensor, ...]:
    """n rows, flat (scale 0.05 .. 1) and peaked (3, 8), each with its own settings."""
    scales = torch.tensor([0.05, 0.5, 1.0, 3.0, 8.0, 1.0])[torch.arange(n) % 6]
    x = torch.randn(n, vocab, generator=g) * scales[:, None]
    if bf16:
        x = x.bfloat16().float()
    t = torch.tensor([1.0, 0.6, 1.3, 0.7, 1.0])[torch.arange(n) % 5]
    top_p = torch.tensor([0.5, 0.9, 0.95, 0.999, 1.0, 0.9, 0.8])[torch.arange(n) % 7]
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.0, 0.3, 0.0, 0.02, 0.0])[torch.arange(n) % 8]
    return x, t, top_p, min_p


@pytest.mark.parametrize("vocab", [QWEN_VOCAB, 1024], ids=["v151936", "v1024"])
@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bfloat16"])
def test_kept_set_and_seeded_draws_equal_the_sorted_reference(vocab, bf16):
    g = torch.Generator().manual_seed(vocab + bf16)
    n = 14 if vocab > 1024 else 64
    x, t, top_p, min_p = _rows_of(n, g, vocab, bf16)
    want = _reference(x, t, top_p, min_p)
    got = cut.kept(x, t, top_p, min_p)
    for r in range(n):
        assert torch.equal(got[r] > 0, want[r] > 0), (
            f"row {r}: {int((got[r] > 0).sum())} kept, want {int((want[r] > 0).sum())}"
        )
    assert torch.equal(got, want)
    seeds = list(range(7, 7 + n))
    for step in (0, 5, 1000):
        u = _uniforms(seeds, [step] * n)
        assert cut.draw(x, t, top_p, min_p, u).tolist() == inverse_cdf(want, u).tolist()


def test_equal_logits_keep_the_lowest_ids():
    x = torch.zeros(2, 1024)
    got = cut.kept(x, torch.ones(2), torch.tensor([0.5, 0.999]), torch.zeros(2))
    assert (got[0] > 0).nonzero()[:, 0].tolist() == list(range(512))  # 512 / 1024 reaches 0.5
    assert (got[1] > 0).nonzero()[:, 0].tolist() == list(range(1023))
    big = torch.zeros(1, QWEN_VOCAB)
    want = _reference(big, 1.0, 0.9, 0.0)
    got = cut.kept(big, torch.ones(1), torch.tensor([0.9]), torch.zeros(1))
    assert torch.equal(got, want) and int((got > 0).sum()) == int((want > 0).sum()) > 130_000


def test_masked_logits_and_a_dominant_token():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, QWEN_VOCAB, generator=g).bfloat16().float()
    allowed = torch.randperm(QWEN_VOCAB, generator=g)[:37]
    x[0] = float("-inf")  # a grammar's mask: 37 tokens allowed
    x[0, allowed] = torch.randn(37, generator=g)
    x[1, ::2] = float("-inf")  # half the vocabulary masked
    x[2, :1000] -= 100.0  # logit_bias -100
    x[3, 77] = 60.0  # one dominant token
    x[4, 78], x[4, 77] = 13.0, 13.0  # two tied tokens of about 0.39 each over a flat rest
    t, top_p, min_p = torch.ones(5), torch.tensor([0.9, 0.95, 0.9, 0.9, 0.3]), torch.zeros(5)
    want = _reference(x, t, top_p, min_p)
    got = cut.kept(x, t, top_p, min_p)
    assert torch.equal(got, want)
    assert set((got[0] > 0).nonzero()[:, 0].tolist()) <= set(allowed.tolist())
    assert (got[1, ::2] == 0).all()
    assert (got[3] > 0).nonzero()[:, 0].tolist() == [77]
    assert (got[4] > 0).nonzero()[:, 0].tolist() == [77]  # the tie at the cut: the lower id
    u = _uniforms([1, 2, 3, 4, 5], [0] * 5)
    assert cut.draw(x, t, top_p, min_p, u).tolist() == inverse_cdf(want, u).tolist()


def _row(rid: str, p: SamplingParams, step: int) -> RowInput:
    out = list(range(500, 500 + step))
    return RowInput(rid, [7], 40 + step, 0, [], True, True, params=p, history=(list(range(40)), out), num_output=step)


@pytest.mark.parametrize("mixed", [False, True], ids=["all_flat", "beside_peaked_rows"])
def test_sampler_draws_flat_top_p_rows_without_a_sort(mixed, monkeypatch):
    """Flat rows at Qwen's vocabulary: the head of 1,024 cannot hold their kept set. Alone they
    skip it (no second draw); beside rows their head holds, they are drawn again. Either way no
    sort of the vocabulary, and each seeded flat row draws the reference's token."""
    g = torch.Generator().manual_seed(11)
    n = 8
    x = (torch.randn(n, QWEN_VOCAB, generator=g) * 0.5).bfloat16().float()
    if mixed:
        x[::2] *= 40.0  # peaked: the head holds their kept set
    params = [
        SamplingParams(temperature=[1.0, 0.6, 1.3][i % 3], top_p=[0.9, 0.95, 0.999, 0.5][i % 4], seed=100 + i)
        for i in range(n)
    ]
    redrawn = []
    real = sm.Sampler._redraw

    def spy(self, x, dp, sampled, per, held, *a):
        redrawn.append([not ok for ok in held])
        return real(self, x, dp, sampled, per, held, *a)

    def no_sort(*a, **k):
        raise AssertionError("a sort of the vocabulary")

    monkeypatch.setattr(sm.Sampler, "_redraw", spy)
    monkeypatch.setattr(torch, "sort", no_sort)
    sampler = Sampler()
    for step in (0, 1):
        got, _ = sampler(x.clone(), [_row(f"r{i}", p, step) for i, p in enumerate(params)], list(range(n)))
        t = torch.tensor([p.temperature for p in params])
        top_p = torch.tensor([p.top_p for p in params])
        want = inverse_cdf(_reference(x, t, top_p, 0.0), _uniforms([p.seed for p in params], [step] * n))
        flat = range(1, n, 2) if mixed else range(n)
        assert [got[i][0] for i in flat] == [int(want[i]) for i in flat], f"step {step}"
    assert redrawn == ([[i % 2 == 1 for i in range(n)]] * 2 if mixed else [])


def test_flat_rows_on_the_cpu_cost_no_logsumexp_and_no_top_k(monkeypatch):
    """With the CPU operators, a head group of flat rows is drawn by kernels/cpu_ops.py top_p_draw
    from the softmax alone (no head can hold a row, found from its largest probability): neither
    the rows' logsumexp nor a top-k of the head is spent, and each row draws the reference's token."""
    from kernels import cpu_ops

    assert cpu_ops.available(), f"the CPU operators are not active: {cpu_ops.status()}"
    g = torch.Generator().manual_seed(12)
    n = 6
    x = (torch.randn(n, QWEN_VOCAB, generator=g) * 0.5).bfloat16().float()
    params = [
        SamplingParams(temperature=[1.0, 0.7][i % 2], top_p=[0.9, 0.8, 0.99][i % 3], seed=40 + i) for i in range(n)
    ]

    def spent(*a, **k):
        raise AssertionError("a logsumexp or a top-k of the flat rows")

    monkeypatch.setattr(cut, "logsumexp", spent)
    monkeypatch.setattr(torch, "topk", spent)
    sampler = Sampler()
    t = torch.tensor([p.temperature for p in params])
    want = _reference(x, t, torch.tensor([p.top_p for p in params]), 0.0)
    for step in (0, 1, 2):
        got, _ = sampler(x.clone(), [_row(f"r{i}", p, step) for i, p in enumerate(params)], list(range(n)))
        u = _uniforms([p.seed for p in params], [step] * n)
        assert [g[0] for g in got] == inverse_cdf(want, u).tolist(), f"step {step}"

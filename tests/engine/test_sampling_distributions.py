"""Drawn tokens against the distribution vLLM's sampling parameters define, from a plain loop over
one row's logits written here (temperature, then min-p relative to the most likely token, then
top-k, then top-p over what those keep, renormalized): thousands of seeded draws of one fixed
row, as separate requests in one batched call, pass a chi-square test at vocabularies of 1,024
(float32 and bfloat16-rounded logits) and 151,936 (Qwen's). The same counts fail the test against
the mistakes a filter can make (top-p before temperature, top-k off by one, min-p after top-p or
before temperature), so the bound has the power to see them. A temperature too small to divide
by is greedy, as vLLM's below 1e-5: no out-of-vocabulary id from an infinite logit."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine.sampling import Sampler
from engine.sampling_params import SamplingParams
from engine.step import RowInput


def reference(logits: torch.Tensor, p: SamplingParams, mistake: str = "") -> dict[int, float]:
    """{token: probability} of one row, float64, token by token. mistake: a wrong filter to model
    ("top_p_before_temperature", "top_k_plus_one", "min_p_after_top_p", "min_p_before_temperature")."""
    x = logits.double()
    order = sorted(range(x.shape[0]), key=lambda t: (-float(x[t]), t))
    temp = 1.0 if mistake == "top_p_before_temperature" else p.temperature
    w = {t: math.exp((float(x[t]) - float(x[order[0]])) / temp) for t in order}
    if mistake == "min_p_before_temperature":
        w1 = {t: math.exp(float(x[t]) - float(x[order[0]])) for t in order}
        order = [t for t in order if w1[t] >= p.min_p]
    elif mistake != "min_p_after_top_p":
        order = [t for t in order if w[t] >= p.min_p]  # the most likely token's weight is 1
    k = p.top_k + (mistake == "top_k_plus_one")
    if 0 < p.top_k < x.shape[0]:
        order = order[:k]
    total = sum(w[t] for t in order)
    kept, mass = [], 0.0
    for t in order:  # the most likely first, until the kept probability reaches top_p
        if p.top_p < 1.0 and mass >= p.top_p:
            break
        kept.append(t)
        mass += w[t] / total
    if mistake == "min_p_after_top_p":
        kept = [t for t in kept if w[t] >= p.min_p]
    if mistake == "top_p_before_temperature":  # the set found at temperature 1, drawn at p's
        w = {t: math.exp((float(x[t]) - float(x[order[0]])) / p.temperature) for t in kept}
    total = sum(w[t] for t in kept)
    return {t: w[t] / total for t in kept}


def by_logit(x: torch.Tensor, dist: dict[int, float] | Counter) -> dict[float, float]:
    """Counts or probabilities per distinct logit value: tokens whose logits tie (bfloat16 rounds
    many together) are one cell, since which of equal tokens a filter's cut keeps is arbitrary
    (vLLM's sort is not stable either); every token that differs is its own."""
    out: dict[float, float] = {}
    for t, q in dist.items():
        out[float(x[t])] = out.get(float(x[t]), 0.0) + q
    return out


def chi2(counts: dict[float, float], ref: dict[float, float], n: int) -> tuple[float, float]:
    """(statistic, bound): cells expected under 5 draws pooled into one (a token outside the
    reference counts there too); the bound is chi-square's upper 3e-6 tail (Wilson-Hilferty)."""
    big = {t: q for t, q in ref.items() if q * n >= 5}
    cells = [(counts.get(t, 0.0), q * n) for t, q in big.items()]
    rest = 1.0 - sum(big.values())
    cells.append((n - sum(o for o, _ in cells), rest * n))
    stat = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    stat += sum(o * 1e9 for o, e in cells if e <= 0 and o)  # drawn where the reference has nothing
    df = max(1, sum(e > 0 for _, e in cells) - 1)
    return stat, df * (1 - 2 / (9 * df) + 4.5 * math.sqrt(2 / (9 * df))) ** 3


def draws(logits: torch.Tensor, p: SamplingParams, n: int, salt: int = 0) -> Counter:
    """n seeded requests sampling their first token from the same row, in one sampler call."""
    rows = [
        RowInput(f"r{i}", [1], 0, 0, [], True, True, params=SamplingParams(**{**p.to_dict(), "seed": salt + i}))
        for i in range(n)
    ]
    toks, _ = Sampler()(logits[None].expand(n, -1), rows, list(range(n)))
    return Counter(t[0] for t in toks)


def _row(v: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A row with a handful of likely tokens over a random tail, rounded to dtype (bfloat16 ties)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(v, generator=g) * 1.5
    head = torch.randperm(v, generator=g)[:10]
    x[head] += torch.tensor([6.0, 5.7, 5.5, 5.2, 5.0, 4.8, 4.5, 4.3, 4.0, 3.6])
    return x.to(dtype).float()


# each setting with the mistakes whose distribution its counts must reject
SETTINGS = {
    "temperature": (dict(temperature=1.6), []),
    "top_p_cold": (dict(temperature=0.5, top_p=0.8), ["top_p_before_temperature"]),
    "top_p_hot": (dict(temperature=1.5, top_p=0.6), ["top_p_before_temperature"]),
    "top_k": (dict(temperature=1.2, top_k=5), ["top_k_plus_one"]),
    "min_p": (dict(temperature=1.6, min_p=0.3), ["min_p_before_temperature"]),
    "min_p_top_p": (dict(temperature=0.9, top_p=0.6, min_p=0.4), ["min_p_after_top_p"]),
    "all": (dict(temperature=0.8, top_k=6, top_p=0.75, min_p=0.3), ["min_p_after_top_p"]),
}


def check(x: torch.Tensor, kw: dict, n: int, mistakes: list[str]) -> None:
    """n draws of row x under kw pass the chi-square test against the reference and fail it
    against each of the mistakes."""
    p = SamplingParams(**kw)
    counts = by_logit(x, draws(x, p, n))
    stat, bound = chi2(counts, by_logit(x, reference(x, p)), n)
    assert stat < bound, f"{kw}: chi2 {stat:.1f} >= {bound:.1f}"
    for m in mistakes:
        wrong, bound = chi2(counts, by_logit(x, reference(x, p, m)), n)
        assert wrong > bound, f"{kw}: the test cannot tell {m} apart (chi2 {wrong:.1f})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", SETTINGS)
def test_first_token_distribution_matches_reference(name, dtype):
    kw, mistakes = SETTINGS[name]
    check(_row(1024, dtype), kw, 2000, mistakes)


@pytest.mark.parametrize(
    "kw, mistakes",
    [
        (dict(temperature=1.2, top_p=0.75, min_p=0.1), ["min_p_after_top_p"]),
        (dict(temperature=0.7, top_k=20, top_p=0.95), []),
    ],
    ids=["head_top_p_min_p", "top_k_top_p"],
)
def test_first_token_distribution_at_qwen_vocabulary(kw, mistakes):
    check(_row(151_936, torch.bfloat16, seed=1), kw, 600, mistakes)


@pytest.mark.parametrize("t", [1e-6, 1e-30, 1e-40, 1e-45])
def test_temperature_below_vllm_epsilon_is_greedy(t):
    x = _row(1024, torch.float32) * 8  # logits / 1e-40 overflow to inf: softmax NaN drew id 1024
    assert set(draws(x, SamplingParams(temperature=t), 8)) == {int(x.argmax())}
    assert SamplingParams(temperature=t).greedy and not SamplingParams(temperature=1e-5).greedy


def test_tiny_temperature_through_the_engine(llm_hv2):
    """The offline engine: a temperature of 1e-40 decodes greedily where its out-of-vocabulary id
    failed the next step's embedding lookup."""
    prompt = [[5, 17, 300, 42, 9, 77, 1000, 3]]
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    tiny = SamplingParams(max_tokens=4, temperature=1e-40, seed=1, ignore_eos=True)
    want = llm_hv2.generate(prompt_token_ids=prompt, sampling_params=greedy)[0].output_token_ids
    assert llm_hv2.generate(prompt_token_ids=prompt, sampling_params=tiny)[0].output_token_ids == want

"""The batched sampler (engine/sampling) against plain per-row references written here: the
support sets of top-k / top-p / min-p exactly, their probabilities, empirical distributions of
mixed batches within a chi-square bound, penalties / logit_bias / the min_tokens ban exactly
(step after step, from the token counts the sampler keeps), logprobs of the model's own
distribution, SplitMix64 and the race's per-token keys against their published definition, the
race's indifference to the candidates' order and to rounding-level changes of the logits, and
seeded rows that draw the same tokens alone, in any batch, and with or without drafts."""

from __future__ import annotations

import math
import sys
from collections import Counter
from contextlib import contextmanager

import pytest
import torch

from engine.sampling import Sampler
from engine.sampling.filters import candidate_probs, race
from engine.sampling.penalties import TokenCounts
from engine.sampling.rng import as_int64, seeded_uniforms, splitmix64, token_exponentials
from engine.sampling_params import SamplingParams
from engine.step import RowInput

M64 = (1 << 64) - 1


def _splitmix64_ref(seed: int, n: int) -> int:
    """Output n (1-based) of SplitMix64 seeded with `seed`, on Python ints (Steele et al. 2014)."""
    z = (seed + n * 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _naive_probs(logits: list[float], p: SamplingParams) -> dict[int, float]:
    """One row, as docs/api.md reads (vLLM's order): temperature, min-p, top-k, then top-p over
    what those keep, renormalized; float64 on Python lists."""
    order = sorted(range(len(logits)), key=lambda t: -logits[t])
    m = logits[order[0]]
    w = {t: math.exp((logits[t] - m) / p.temperature) for t in order}
    order = [t for t in order if w[t] >= p.min_p]  # the most likely token's weight is 1
    if 0 < p.top_k < len(logits):
        order = order[: p.top_k]
    z = sum(w[t] for t in order)
    probs = {t: w[t] / z for t in order}
    kept, mass = [], 0.0
    for t in order:  # the most likely first; stop once the kept mass reaches top_p
        if mass >= p.top_p and p.top_p < 1.0:
            break
        kept.append(t)
        mass += probs[t]
    z = sum(probs[t] for t in kept)
    return {t: probs[t] / z for t in kept}


def _row(rid, p, *, output=(), prompt=(1, 2, 3), drafts=(), num_output=None) -> RowInput:
    out = list(output)
    return RowInput(
        rid,
        [(out or list(prompt))[-1], *drafts],
        len(prompt) + len(out) - 1,
        0,
        [],
        True,
        True,
        params=p,
        num_draft=len(drafts),
        history=(list(prompt), out),
        num_output=len(out) if num_output is None else num_output,
    )


def _sample(sampler, logits, rows):
    """Rows one logit row each (k + 1 for a row with k drafts), in order."""
    first, j = [], 0
    for r in rows:
        first.append(j)
        j += r.num_draft + 1
    return sampler(logits.clone(), rows, first)


FILTERS = {
    "top_k": dict(top_k=5),
    "top_p": dict(top_p=0.7),
    "min_p": dict(min_p=0.2),
    "k+p+min_p": dict(top_k=8, top_p=0.9, min_p=0.05, temperature=0.6),
    "hot": dict(temperature=1.7, top_p=0.95),
    "k_past_limit": dict(top_k=2000, top_p=0.5),
    "temperature_only": dict(temperature=1.3),
}


def test_splitmix64_matches_its_definition():
    assert _splitmix64_ref(1234567, 1) == 6457827717110365317  # the published first output
    seeds = [0, 1, 7, 1234567, 2**62 + 3, 2**63, 2**64 - 1]
    for n in (1, 2, 3, 1000, 2**40):
        got = splitmix64(torch.tensor([as_int64(s) for s in seeds]), torch.full((len(seeds),), n))
        assert [g & M64 for g in got.tolist()] == [_splitmix64_ref(s, n) for s in seeds]
    u = seeded_uniforms(torch.tensor([as_int64(s) for s in seeds]), torch.full((len(seeds),), 4))
    assert u.tolist() == [(_splitmix64_ref(s, 5) >> 40) / 2**24 for s in seeds]
    ids = torch.tensor([0, 1, 151_935, 2**20])
    e = token_exponentials(torch.tensor([as_int64(s) for s in seeds]), torch.full((len(seeds),), 4), ids.expand(7, 4))
    for s, row in zip(seeds, e.tolist()):
        keys = [_splitmix64_ref(_splitmix64_ref(s, 5), t + 1) >> 41 for t in ids.tolist()]
        assert row == pytest.approx([-math.log((k + 0.5) / 2**23) for k in keys], rel=1e-6)


@pytest.mark.parametrize("kw", FILTERS.values(), ids=FILTERS.keys())
def test_filter_support_and_probabilities_match_reference(kw):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 3000, generator=g) * 2.5
    p = SamplingParams(**{"temperature": 1.0, **kw})
    vals, ids = torch.sort(logits, -1, descending=True)
    n = logits.shape[0]
    got = candidate_probs(
        vals,
        torch.full((n,), p.temperature),
        torch.full((n,), p.top_k if p.top_k > 0 else 0),
        torch.full((n,), p.top_p),
        torch.full((n,), p.min_p),
    )
    for b in range(n):
        want = _naive_probs(logits[b].tolist(), p)
        mine = {int(t): float(q) for t, q in zip(ids[b], got[b]) if q > 0}
        assert set(mine) == set(want), f"row {b}"
        assert max(abs(mine[t] - want[t]) for t in want) < 1e-5


@pytest.mark.parametrize("scale", [3.0, 0.05], ids=["peaked_head", "flat_sorted"])
def test_top_p_min_p_head_or_sort_draw_in_reference_support(scale, monkeypatch):
    """Rows with top-p or min-p and no top-k draw from the 1024 most likely tokens when those
    hold what the filters keep (peaked rows), else again from the sorted vocabulary (flat rows,
    each found from its own check): either way every draw is in the reference support."""
    import engine.sampling.sampler as sm

    v, reps = 5000, 40
    g = torch.Generator().manual_seed(12)
    settings = [
        SamplingParams(top_p=0.9),
        SamplingParams(min_p=0.3, temperature=0.8),
        SamplingParams(top_p=0.6, min_p=0.05, temperature=1.2),
    ]
    logits = torch.randn(len(settings), v, generator=g) * scale
    redrawn = []
    real = sm.Sampler._redraw

    def spy(self, x, dp, sampled, per, held, *a):
        redrawn.append(sum(not ok for ok in held))
        return real(self, x, dp, sampled, per, held, *a)

    monkeypatch.setattr(sm.Sampler, "_redraw", spy)
    rows = [
        _row(f"{i}-{r}", SamplingParams(**{**p.to_dict(), "seed": 1000 * i + r}))
        for i, p in enumerate(settings)
        for r in range(reps)
    ]
    toks, _ = _sample(Sampler(), logits.repeat_interleave(reps, 0), rows)
    assert redrawn == ([] if scale > 1 else [len(rows)])
    for i, p in enumerate(settings):
        support = set(_naive_probs(logits[i].tolist(), p))
        drawn = {t[0] for t in toks[i * reps : (i + 1) * reps]}
        assert drawn <= support and len(drawn) > 1, f"setting {i}"


def test_inverse_cdf_never_draws_probability_zero():
    from engine.sampling.filters import inverse_cdf

    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0, 0.0, 0.0]])
    for u in (0.0, 0.29, 0.3, 0.5, 1 - 2**-24):
        j = inverse_cdf(probs, torch.full((2,), u))
        assert (probs.gather(1, j[:, None]) > 0).all(), u
    assert inverse_cdf(probs, torch.tensor([0.0, 0.0])).tolist() == [1, 0]
    assert inverse_cdf(probs, torch.full((2,), 1 - 2**-24)).tolist() == [3, 1]


def test_race_never_draws_probability_zero_and_ignores_the_candidates_order():
    g = torch.Generator().manual_seed(6)
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0, 0.0]]).expand(500, 6)
    ids = torch.arange(6).expand(500, 6)
    seeds = torch.randint(-(2**63), 2**63 - 1, (500,), generator=g)
    pos = torch.zeros(500, dtype=torch.long)
    pick = race(probs, token_exponentials(seeds, pos, ids))
    assert set(pick.tolist()) == {1, 3}
    perm = torch.randperm(6, generator=g)  # the same candidates in another order: the same ids win
    again = ids[:, perm].gather(1, race(probs[:, perm], token_exponentials(seeds, pos, ids[:, perm]))[:, None])
    assert again[:, 0].tolist() == pick.tolist()


def test_seeded_filtered_draws_survive_rounding_level_changes():
    """A moved request's logits are recomputed (a prefill of prompt + output where the first node
    decoded token by token) and differ by rounding. With bfloat16-like ties in the logits and a
    relative change of 4e-7, a seeded top-p row keeps its token and a top-k + top-p row almost
    always does: the race keys each token by its id, where one uniform over the sorted
    candidates moved with every reordered tie (16% and 29% of these draws)."""
    g = torch.Generator().manual_seed(0)
    n, v = 1000, 1024
    x = torch.randn(n, v, generator=g).bfloat16().float()
    moved = x * (1 + 4e-7 * torch.randn(n, v, generator=g))
    for kw, most in ((dict(top_p=0.9), 0), (dict(top_k=50, top_p=0.95, temperature=0.7), n // 100)):
        rows = [_row(f"r{i}", SamplingParams(**kw, seed=i)) for i in range(n)]
        before, _ = _sample(Sampler(), x, rows)
        after, _ = _sample(Sampler(), moved, rows)
        assert sum(a != b for a, b in zip(before, after)) <= most, kw


def _chi2_bound(df: int, z: float = 4.5) -> float:
    """Upper quantile of chi-square (Wilson-Hilferty), about 3e-6 one-sided at z 4.5."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("seeded", [False, True], ids=["engine_generator", "per_request_seeds"])
def test_mixed_batch_distributions_match_reference(seeded):
    """Every FILTERS setting and greedy in one batch over a 12-token vocabulary, 3000 draws each:
    draws stay in the reference support and the counts pass a chi-square test."""
    v, reps = 12, 3000
    base = torch.tensor([2.0, 1.6, 1.5, 1.1, 0.9, 0.5, 0.2, 0.0, -0.4, -1.0, -2.0, -3.0])
    settings = [SamplingParams(**{"temperature": 1.0, **kw}) for kw in FILTERS.values()] + [
        SamplingParams(temperature=0.0)
    ]
    perm = [torch.randperm(v, generator=torch.Generator().manual_seed(i)) for i in range(len(settings))]
    sampler = Sampler(seed=5)
    counts = [Counter() for _ in settings]
    rows, logits = [], []
    for i, p in enumerate(settings):
        for r in range(reps):
            q = SamplingParams(**{**p.to_dict(), "seed": 100_000 * i + r}) if seeded and not p.greedy else p
            rows.append(_row(f"{i}-{r}", q))
            logits.append(base[perm[i]])
    toks, _ = _sample(sampler, torch.stack(logits), rows)
    for k, t in enumerate(toks):
        counts[k // reps][t[0]] += 1
    for i, p in enumerate(settings):
        want = _naive_probs(base[perm[i]].tolist(), p) if not p.greedy else {int(base[perm[i]].argmax()): 1.0}
        assert set(counts[i]) <= set(want), f"setting {i}: drew outside the support"
        if len(want) > 1:
            chi2 = sum((counts[i][t] - reps * q) ** 2 / (reps * q) for t, q in want.items())
            assert chi2 < _chi2_bound(len(want) - 1), f"setting {i}: chi2 {chi2:.1f}"
        else:
            assert counts[i] == {next(iter(want)): reps}


def _naive_adjusted(logits: list[float], p: SamplingParams, prompt, output, eos) -> list[float]:
    """vLLM's order: logit_bias, the min_tokens ban, then the repetition, frequency and presence
    penalties."""
    row = list(logits)
    for t, b in p.logit_bias:
        row[t] += b
    if len(output) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
            row[t] = float("-inf")
    for t in set(prompt) | set(output):
        if p.repetition_penalty != 1.0:
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(output):
        row[t] -= p.presence_penalty + p.frequency_penalty * output.count(t)
    return row


ADJUST = [
    dict(repetition_penalty=1.8, presence_penalty=0.5),
    dict(presence_penalty=1.5, frequency_penalty=0.3, top_k=20, top_p=0.8, temperature=0.7, seed=4),
    dict(repetition_penalty=0.5, frequency_penalty=-0.7),
    dict(logit_bias={3: 2.5, 9: -100.0}, min_tokens=3, stop_token_ids=[4], max_tokens=20),
    dict(temperature=0.0),
    dict(presence_penalty=-1.0, logit_bias={0: 1.0}, min_tokens=2, ignore_eos=True, stop_token_ids=[5], seed=1),
    # the bias before the repetition penalty (vLLM's order): a biased prompt token's sum is divided
    dict(repetition_penalty=2.0, logit_bias={8: 3.0, 2: -4.0, 5: 1.5}, min_tokens=1, stop_token_ids=[2]),
]


def test_penalties_bias_and_ban_match_reference_step_after_step(monkeypatch):
    """Seven rows with different adjustments in one batch for eight steps: the adjusted logits equal
    the per-row reference from the whole history every step, while the token counts are built
    once per request and then only updated by the steps."""
    v, eos = 40, (7,)
    g = torch.Generator().manual_seed(11)
    sampler = Sampler(seed=2, eos_token_ids=eos)
    params = [SamplingParams(**{"temperature": 1.0, **kw}) for kw in ADJUST]
    prompts = [[1, 2, 3, 3, 30], [4, 4, 9], [0, 39, 12], [5, 6], [1], [8, 8, 8, 2], [8, 5, 2]]
    outputs: list[list[int]] = [[] for _ in params]
    builds = 0
    real_build = TokenCounts._build

    def counting_build(self, *a):
        nonlocal builds
        builds += 1
        return real_build(self, *a)

    monkeypatch.setattr(TokenCounts, "_build", counting_build)
    for _ in range(8):
        logits = torch.randn(len(params), v, generator=g) * 3
        rows = [_row(f"r{i}", p, prompt=prompts[i], output=outputs[i]) for i, p in enumerate(params)]
        x = logits.clone()
        sampler.adjust(x, rows, list(range(len(rows))))
        for i, p in enumerate(params):
            want = torch.tensor(_naive_adjusted(logits[i].tolist(), p, prompts[i], outputs[i], eos))
            assert torch.allclose(x[i], want, atol=1e-5), f"row {i} after {len(outputs[i])} tokens"
        toks, _ = _sample(sampler, logits, rows)
        for i, t in enumerate(toks):
            outputs[i] += t
    assert builds == sum(p.penalized for p in params)
    assert any(len(set(o)) < len(o) for o in outputs)  # some repeats were counted
    # a request whose output the scheduler cut back is counted again from its lists
    rows = [_row("r0", params[0], prompt=prompts[0], output=outputs[0][:3])]
    logits = torch.randn(1, v, generator=g) * 3
    x = logits.clone()
    sampler.adjust(x, rows, [0])
    assert torch.allclose(
        x[0], torch.tensor(_naive_adjusted(logits[0].tolist(), params[0], prompts[0], outputs[0][:3], eos)), atol=1e-5
    )


def test_logprobs_are_the_models_own():
    """logprobs: log-softmax of the logits before penalties, bias and temperature (docs/api.md),
    for the token actually drawn; top-n in order."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 50, generator=g) * 2
    params = [
        SamplingParams(temperature=0.8, top_k=10, presence_penalty=1.0, logit_bias={3: 5.0}, logprobs=4, seed=9),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=1.0, seed=3),
    ]
    rows = [_row(f"r{i}", p, output=[3, 4]) for i, p in enumerate(params)]
    toks, lps = _sample(Sampler(), logits, rows)
    assert set(lps) == {"r0", "r1"}
    for i in (0, 1):
        ref = torch.log_softmax(logits[i].double(), -1)
        [(t, lp, top)] = lps[f"r{i}"]
        assert t == toks[i][0] and lp == pytest.approx(ref[t].item(), abs=1e-5)
        n = params[i].logprobs
        assert [i for i, _ in top] == torch.topk(ref, n).indices.tolist()
        assert [v for _, v in top] == pytest.approx(torch.topk(ref, n).values.tolist(), abs=1e-5)


def test_seeded_rows_same_alone_in_any_batch_and_with_drafts():
    """A seeded row draws the same token for the same (seed, position) alone, at another place in
    a batch of other kinds of rows, and at each position of a row with drafts."""
    v = 500
    g = torch.Generator().manual_seed(4)
    p = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.01, seed=2**63 + 17)
    seq = torch.randn(6, v, generator=g) * 2  # one request's logits at its positions 10..15
    alone = [_sample(Sampler(seed=1), seq[j : j + 1], [_row("a", p, num_output=10 + j)])[0][0][0] for j in range(6)]
    assert len(set(alone)) > 1
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, seed=3),
        SamplingParams(top_p=0.5, presence_penalty=1.0),
    ]
    for j in range(6):
        for at in range(len(others) + 1):
            rows = [_row(f"o{i}", q, output=[1, 2]) for i, q in enumerate(others)]
            rows.insert(at, _row("a", p, num_output=10 + j))
            logits = torch.randn(len(rows), v, generator=g)
            logits[at] = seq[j]
            assert _sample(Sampler(seed=at), logits, rows)[0][at] == [alone[j]]
    # drafts equal to the draws are all accepted, plus the bonus token; a wrong draft at 2 stops there
    drafts = alone[:5]
    got = _sample(Sampler(), seq, [_row("a", p, drafts=drafts, num_output=10)])[0][0]
    assert got == alone
    wrong = drafts[:2] + [(drafts[2] + 1) % v] + drafts[3:]
    assert _sample(Sampler(), seq, [_row("a", p, drafts=wrong, num_output=10)])[0][0] == alone[:3]


def test_greedy_drafts_accept_the_argmax_prefix():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(8))
    best = logits.argmax(-1).tolist()
    p = SamplingParams(temperature=0.0)
    assert _sample(Sampler(), logits, [_row("g", p, drafts=best[:3])])[0][0] == best
    assert _sample(Sampler(), logits, [_row("g", p, drafts=[best[0], (best[1] + 1) % 30, best[2]])])[0][0] == best[:2]


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "0.1"])
def test_min_p_validated(bad):
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=bad)


READS = ("tolist", "item", "cpu", "numpy", "__int__", "__index__", "__bool__", "__float__")


@contextmanager
def _host_reads(modules: tuple[str, ...]):
    """(method, module, line) of each tensor-to-host read made from code in these packages."""
    calls: list[tuple[str, str, int]] = []
    saved = {n: getattr(torch.Tensor, n) for n in READS}

    def wrap(name, fn):
        def read(self, *a, **kw):
            f = sys._getframe(1)
            mod = f.f_globals.get("__name__", "")
            if mod.startswith(modules):
                calls.append((name, mod, f.f_lineno))
            return fn(self, *a, **kw)

        return read

    for n, fn in saved.items():
        setattr(torch.Tensor, n, wrap(n, fn))
    try:
        yield calls
    finally:
        for n, fn in saved.items():
            setattr(torch.Tensor, n, fn)


QWEN = dict(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5)


def test_one_host_read_per_decode_step(llm_hv2):
    """Batch 8, greedy and Qwen-sampled rows (seeded and not, with logit_bias and min_tokens):
    one decode step reads the device once (the sampled ids, with a logprobs row's entries). Counted
    from engine.* and, when the CPU operators are built (the engine's CPU path), kernels.* too:
    the PyTorch fallback of paged attention reads its row lengths back by design."""
    from kernels import cpu_ops

    counted = ("engine", "kernels") if cpu_ops.available(torch.float32) else ("engine",)
    e = llm_hv2.engine
    params = (
        [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)] * 3
        + [SamplingParams(max_tokens=8, ignore_eos=True, seed=s, **QWEN) for s in (1, 2)]
        + [
            SamplingParams(max_tokens=8, ignore_eos=True, **QWEN),
            SamplingParams(max_tokens=8, seed=3, logit_bias={5: 1.5}, min_tokens=6, repetition_penalty=1.2),
            SamplingParams(max_tokens=8, temperature=0.0, min_p=0.1, ignore_eos=True),
        ]
    )
    try:
        for i, p in enumerate(params):
            e.add_request([3 + i, 17, 300, 42, 9], p)
        e.step()  # the prompts
        e.step()  # the first decode step builds the token counts
        with _host_reads(counted) as calls:
            e.step()
        assert [c[0] for c in calls] == ["tolist"], calls  # the sampled ids
        e.add_request([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.5, seed=1, logprobs=2))
        e.step()
        with _host_reads(counted) as calls:
            e.step()
        assert [c[0] for c in calls] == ["tolist"], calls
    finally:  # the engine is shared: leave it empty
        while e.has_unfinished():
            e.step()


def test_seeded_request_same_alone_in_a_batch_and_speculating(ckpt_hv2, llm_hv2):
    """Qwen's settings with a seed: the same tokens alone, in a batch of other requests, and with
    n-gram drafts that the draws verify (the drafts change how many steps, not which tokens)."""
    from engine import LLM

    prompt = [5, 17, 300, 42, 9, 77, 1000, 3]
    sp = SamplingParams(max_tokens=24, ignore_eos=True, seed=2024, min_p=0.02, **QWEN)
    alone = llm_hv2.generate(prompt_token_ids=[prompt], sampling_params=sp)[0].output_token_ids
    others = [
        SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
    ]
    mixed = llm_hv2.generate(prompt_token_ids=[[1, 2, 3], prompt, [9] * 40], sampling_params=[others[0], sp, others[1]])
    assert mixed[1].output_token_ids == alone
    spec = SamplingParams(max_tokens=24, ignore_eos=True, seed=2024, min_p=0.02, temperature=0.7, top_p=0.8, top_k=20)
    plain = llm_hv2.generate(prompt_token_ids=[prompt], sampling_params=spec)[0].output_token_ids
    with LLM(ckpt_hv2, dtype="float32", num_speculative_tokens=2) as llm:
        llm.engine.proposer = lambda toks, k: toks[-k:]  # always something to verify
        assert llm.generate(prompt_token_ids=[prompt], sampling_params=spec)[0].output_token_ids == plain
        assert llm.engine.scheduler.num_draft_tokens > 0


def test_seeded_tokens_same_under_tensor_parallel(ckpt_hv2, llm_hv2):
    """Rank 0 of a TP 2 engine draws a seeded request's tokens as a TP 1 engine does."""
    from engine import LLM

    prompts = [[5, 17, 300, 42, 9, 77, 1000, 3], [4, 4, 4, 8]]
    sps = [
        SamplingParams(max_tokens=16, ignore_eos=True, seed=77, **QWEN),
        SamplingParams(max_tokens=16, ignore_eos=True, seed=78, temperature=1.0),
    ]
    want = [o.output_token_ids for o in llm_hv2.generate(prompt_token_ids=prompts, sampling_params=sps)]
    with LLM(ckpt_hv2, dtype="float32", tensor_parallel_size=2) as llm:
        assert [o.output_token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sps)] == want

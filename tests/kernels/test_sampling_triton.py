"""The sampler's fused Triton ops (kernels/triton/sampling.py) against the PyTorch path they
replace on CUDA (engine/sampling): the per-token SplitMix64 keys bit for bit, the drawn ids of
sorted candidates under every filter (given the same seeds), the head check, and the token-count
table's penalties and update, over shapes with readable ids and a fixed seed. Without a GPU the
kernels run under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from engine.sampling.filters import candidate_probs, head_suffices, kept_log_total, race
from engine.sampling.penalties import TokenCounts
from engine.sampling.rng import RACE_BITS, as_int64, splitmix64, token_exponentials
from kernels.triton.sampling import draw_triton, penalties_triton, record_triton
from tests.helpers.kernel_testing import DEVICE

FILTERS = {
    "top_k": (5, 1.0, 0.0, 1.0),
    "top_p": (0, 0.7, 0.0, 0.8),
    "min_p": (0, 1.0, 0.2, 1.2),
    "k_p_min": (8, 0.9, 0.05, 0.6),
    "min_p_then_p": (0, 0.5, 0.1, 0.5),  # top-p over what min-p keeps (vLLM's order) draws apart here
    "plain_topk_all": (0, 1.0, 0.0, 1.0),
}


def _rows(m, k, p, mp, t):
    return (
        torch.full((m,), t),
        torch.full((m,), k, dtype=torch.long),
        torch.full((m,), p),
        torch.full((m,), mp),
    )


def _race_ref(probs, ids, seeds, ctr):
    """The PyTorch path's pick: the race over each candidate's (seed, counter, id) exponential."""
    return ids.gather(1, race(probs, token_exponentials(seeds, ctr, ids))[:, None])[:, 0]


@pytest.mark.parametrize("c", [20, 100, 1024], ids=lambda c: f"C{c}")
@pytest.mark.parametrize("kind", FILTERS, ids=FILTERS.keys())
def test_draw_picks_the_reference_ids(kind, c):
    g = torch.Generator().manual_seed(c)
    m = 24
    logits = torch.randn(m, 3000, generator=g) * 2.5
    vals, ids = torch.topk(logits, c, dim=-1)
    temperature, top_k, top_p, min_p = _rows(m, *FILTERS[kind])
    seeds = torch.tensor([as_int64(s) for s in [0, 1, 2**63 + 5, 12345] * (m // 4)])
    ctr = torch.arange(m, dtype=torch.long) * 7
    seeded = (torch.arange(m) % 3 != 0).long()
    rand = torch.randint(-(2**63), 2**63 - 1, (m,), generator=g)
    keys = torch.where(seeded.bool(), seeds, rand)
    probs = candidate_probs(vals, temperature, top_k if kind != "plain_topk_all" else None, top_p, min_p)
    want = _race_ref(probs, ids, keys, ctr)
    tokens = torch.full((m + 3,), -1, dtype=torch.long)
    q = torch.randperm(m + 3, generator=g)[:m]
    draw_triton(vals, ids, temperature, top_k, top_p, min_p, seeds, ctr, seeded, rand, q, tokens)
    got = tokens[q]
    assert got.tolist() == want.tolist()  # one key per token: nothing rounds apart as a cumulative sum did
    kept = probs.gather(1, (ids == got[:, None]).float().argmax(1, keepdim=True))[:, 0]
    assert (kept > 0).all()


@pytest.mark.parametrize("scale", [3.0, 0.05], ids=["peaked", "flat"])
def test_head_draw_and_check_match_the_reference(scale):
    g = torch.Generator().manual_seed(5)
    m, head = 16, 256
    logits = torch.randn(m, 4000, generator=g) * scale
    temperature = torch.full((m,), 0.9)
    top_p = torch.tensor([0.9, 1.0, 0.8, 0.95] * (m // 4))
    min_p = torch.tensor([0.0, 0.3, 0.1, 0.02] * (m // 4))
    vals, ids = torch.topk(logits, head, dim=-1)
    total = kept_log_total(logits, temperature, min_p)  # over min-p's tokens: top-p comes after it
    want_held = head_suffices(vals, total, temperature, top_p, min_p)
    seeds, ctr = torch.arange(m, dtype=torch.long), torch.zeros(m, dtype=torch.long)
    tokens = torch.zeros(m, dtype=torch.long)
    no_k, all_seeded = torch.zeros(m, dtype=torch.long), torch.ones(m, dtype=torch.long)
    filters = (temperature, no_k, top_p, min_p)
    held = draw_triton(vals, ids, *filters, seeds, ctr, all_seeded, ctr, torch.arange(m), tokens, total)
    assert held.bool().tolist() == want_held.tolist()
    if scale > 1:
        probs = candidate_probs(vals, temperature, None, top_p, min_p, total)
        assert tokens.tolist() == _race_ref(probs, ids, seeds, ctr).tolist()


def _table(g, rows, width, vocab):
    tc = TokenCounts(vocab, torch.device("cpu"))
    tc._resize(rows, width)
    for r in range(rows):
        n = int(torch.randint(1, width - 1, (1,), generator=g))
        toks = torch.randperm(vocab, generator=g)[:n].sort().values
        tc.tok[r, :n] = toks
        tc.cnt[r, :n] = torch.randint(0, 3, (n,), generator=g, dtype=torch.int32)
        tc.inp[r, :n] = torch.rand(n, generator=g) < 0.5
        tc.size[r] = n
    return tc


@pytest.mark.parametrize("width", [16, 64, 2048], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("which", ["rep", "pf", "both"])
def test_penalties_match_the_table_reference(width, which):
    g = torch.Generator().manual_seed(width)
    tc = _table(g, 6, width, 3000)
    x = torch.randn(9, 3000, generator=g) * 3
    pos, rows = torch.tensor([8, 0, 3, 5]), torch.tensor([2, 5, 0, 3])
    rep = torch.tensor([1.3, 0.8, 1.5, 2.0]) if which in ("rep", "both") else None
    pf = torch.tensor([[1.5, 0.0], [0.0, 0.7], [1.0, 1.0], [-0.5, 0.2]]) if which in ("pf", "both") else None
    want = x.clone()
    tc.apply(want, pos, rows, rep, pf)
    got = x.clone()
    penalties_triton(got, pos, rows, tc.tok, tc.cnt, tc.inp, tc.size, rep, pf)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("width", [16, 2048], ids=lambda w: f"W{w}")
def test_record_matches_the_table_reference(width):
    g = torch.Generator().manual_seed(width + 1)
    ref = _table(g, 6, width, 3000)
    rows = torch.tensor([4, 1, 0, 5])
    tokens = torch.tensor([int(ref.tok[4, 0]), 2999, int(ref.tok[0, int(ref.size[0]) - 1]), 7, 11])
    at = torch.tensor([0, 1, 2, 4])
    got = TokenCounts(3000, torch.device("cpu"))
    got.tok, got.cnt, got.inp, got.size = ref.tok.clone(), ref.cnt.clone(), ref.inp.clone(), ref.size.clone()
    ref.record(rows, tokens, at)
    record_triton(rows, at, tokens, got.tok, got.cnt, got.size)
    assert torch.equal(got.size, ref.size)
    for r in range(6):
        n = int(ref.size[r])
        assert got.tok[r, :n].tolist() == ref.tok[r, :n].tolist(), r
        assert got.cnt[r, :n].tolist() == ref.cnt[r, :n].tolist(), r


def test_token_keys_are_splitmix64s():
    """Over 1024 equally likely candidates the race picks the token whose key (the top 23 bits of
    SplitMix64 output id + 1 seeded with output counter + 1 of the row's seed) is largest: the
    kernel agrees with engine/sampling/rng.py, for seeds over the whole 64-bit range, large
    counters and candidates in any order."""
    g = torch.Generator().manual_seed(9)
    m = 64
    seeds = torch.randint(-(2**63), 2**63 - 1, (m,), generator=g)
    ctr = torch.randint(0, 2**40, (m,), generator=g)
    vals = torch.zeros(m, 1024)
    ids = torch.stack([torch.randperm(151_936, generator=g)[:1024] for _ in range(m)])
    tokens = torch.zeros(m, dtype=torch.long)
    ones, zeros = torch.ones(m), torch.zeros(m)
    filters = (ones, torch.zeros(m, dtype=torch.long), ones, zeros)
    draw_triton(vals, ids, *filters, seeds, ctr, torch.ones(m, dtype=torch.long), ctr, torch.arange(m), tokens)
    keys = splitmix64(splitmix64(seeds, ctr + 1)[:, None], ids + 1)
    top = ((keys >> (64 - RACE_BITS)) & ((1 << RACE_BITS) - 1)).argmax(-1)
    assert tokens.tolist() == ids.gather(1, top[:, None])[:, 0].tolist()


def test_kernels_checked_once_and_pytorch_where_they_do_not_build(monkeypatch, caplog):
    import kernels.triton.sampling as ks

    ks.available.cache_clear()
    assert ks.available(torch.device("cpu"))  # the interpreter here, the compiled kernels on a GPU

    def broken(*a, **kw):
        raise RuntimeError("no such instruction")

    monkeypatch.setattr(ks, "draw_triton", broken)
    ks.available.cache_clear()
    assert not ks.available(torch.device("cpu"))
    assert "sampling in PyTorch ops" in caplog.text and "no such instruction" in caplog.text
    ks.available.cache_clear()


@pytest.mark.gpu
def test_compiled_kernels_on_cuda_match_the_cpu_references():
    """The same checks with the compiled kernels on CUDA tensors against the PyTorch path on the
    CPU (tools/gpu_check.sh runs `gpu` tests only)."""
    g = torch.Generator().manual_seed(21)
    m, c = 64, 20
    logits = torch.randn(m, 151_936, generator=g) * 4
    vals, ids = torch.topk(logits, c, dim=-1)
    temperature, top_k, top_p, min_p = _rows(m, 20, 0.8, 0.0, 0.7)
    seeds, ctr = torch.arange(m, dtype=torch.long) * 977, torch.arange(m, dtype=torch.long)
    probs = candidate_probs(vals, temperature, top_k, top_p, min_p)
    want = _race_ref(probs, ids, seeds, ctr)
    dev = [t.cuda() for t in (vals, ids, temperature, top_k, top_p, min_p, seeds, ctr)]
    tokens = torch.zeros(m, dtype=torch.long, device="cuda")
    ones, q = torch.ones(m, dtype=torch.long, device="cuda"), torch.arange(m, device="cuda")
    draw_triton(*dev, ones, dev[7], q, tokens)
    assert (tokens.cpu() == want).float().mean() >= 0.95
    ref = _table(g, 6, 64, 3000)
    x = torch.randn(9, 3000, generator=g) * 3
    pos, rows = torch.tensor([8, 0, 3, 5]), torch.tensor([2, 5, 0, 3])
    rep, pf = torch.tensor([1.3, 0.8, 1.5, 2.0]), torch.tensor([[1.5, 0.0], [0.0, 0.7], [1.0, 1.0], [-0.5, 0.2]])
    want_x = x.clone()
    ref.apply(want_x, pos, rows, rep, pf)
    tab = [t.cuda() for t in (ref.tok, ref.cnt, ref.inp, ref.size)]
    got_x = x.cuda()
    penalties_triton(got_x, pos.cuda(), rows.cuda(), *tab, rep.cuda(), pf.cuda())
    torch.testing.assert_close(got_x.cpu(), want_x, rtol=1e-6, atol=1e-6)
    sampled = torch.tensor([int(ref.tok[2, 0]), 2999, 5, 7])
    ref.record(rows, sampled, torch.arange(4))
    record_triton(rows.cuda(), torch.arange(4, device="cuda"), sampled.cuda(), tab[0], tab[1], tab[3])
    assert torch.equal(tab[3].cpu(), ref.size)
    for r in range(6):
        n = int(ref.size[r])
        assert tab[0][r, :n].tolist() == ref.tok[r, :n].tolist() and tab[1][r, :n].tolist() == ref.cnt[r, :n].tolist()


def test_drafted_penalty_rows_in_the_kernels(monkeypatch):
    """Rows with penalties, logit_bias, min_tokens and logprobs carrying drafts, the penalties,
    count updates and draws in the kernels: the tokens and logprobs of one-token steps
    (tests/engine/test_sampler_drafts.py)."""
    from tests.engine.test_sampler_drafts import check_drafted_batch

    monkeypatch.setenv("PDSERVE_FORCE_TRITON", "1")
    check_drafted_batch(DEVICE)

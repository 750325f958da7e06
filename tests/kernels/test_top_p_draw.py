"""The CPU top-p / min-p draw (kernels/cpu_ops.py top_p_draw) against a naive reference written
here (each row sorted by probability, ties to the lower id, the mass above each token summed in
float64 in that order; min-p first, then top-p over what it keeps) and against its PyTorch
reference (engine/sampling/cut.py kept, then inverse_cdf): the same kept set, the same token at
the same uniform. Rows flat and peaked, float32 and bfloat16 logits (whose ties fall at the cut),
top_p from 1e-6 to 1, min-p, -inf masks, equal logits, a dominant token, two tied at the cut; a
batch whose cuts lie deep in a tail (float64 sums there are not exact); rows of NaN."""

from __future__ import annotations

import pytest
import torch

from engine.sampling import cut
from engine.sampling.filters import inverse_cdf
from kernels import cpu_ops

QWEN_VOCAB = 151_936
EXACT = 0x31000000  # the bits of 2^-29: kept probabilities at least this large sum exactly in float64


def _naive(p: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """bool [N, V]: the kept tokens of probability above 0, row by row from the sorted row."""
    out = torch.zeros(p.shape, dtype=torch.bool)
    for r in range(p.shape[0]):
        ps, order = torch.sort(p[r], descending=True, stable=True)  # ties keep id order
        keep = ps >= min_p[r] * ps[0]
        total = float(ps[keep].double().sum()) if min_p[r] > 0 else 1.0  # min_p 0: the softmax's own 1
        above = ps.double().cumsum(0) - ps.double()
        keep &= (above < float(top_p[r]) * total) | bool(top_p[r] >= 1.0)
        out[r, order[keep]] = True
    return out & (p > 0)


def _kept(p: torch.Tensor, cuts: torch.Tensor) -> torch.Tensor:
    """bool [N, V]: the operator's kept set from its cuts, the tokens of probability 0 left out."""
    bits, ids = p.view(torch.int32).long(), torch.arange(p.shape[1])
    return ((bits > cuts[:, :1]) | ((bits == cuts[:, :1]) & (ids < cuts[:, 1:]))) & (p > 0)


def _rows(vocab: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """13 rows of logits and their settings."""
    g = torch.Generator().manual_seed(vocab)
    n = 13
    scales = torch.tensor([0.05, 0.5, 1.0, 3.0, 8.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 3.0])
    x = torch.randn(n, vocab, generator=g) * scales[:, None]
    x[7] = float("-inf")  # a grammar's mask: 37 tokens allowed
    x[7, torch.randperm(vocab, generator=g)[:37]] = torch.randn(37, generator=g)
    x[8, ::2] = float("-inf")
    x[10, 77] = 60.0  # one dominant token
    x[11, 78] = x[11, 77] = 13.0  # two tied tokens of about 0.39 each (at vocab 151,936)
    x[12] = x[12].round()  # many ties
    x = x.to(dtype).float()
    t = torch.tensor([1.0, 0.6, 1.3, 0.7, 1.0, 1.0, 1.0, 1.0, 0.8, 1.0, 1.0, 1.0, 1.0])
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.999, 1e-6, 0.99999994, 1.0, 0.9, 0.9, 0.5, 0.9, 0.3, 0.8])
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.0, 0.0, 0.0, 0.3, 0.0, 0.02, 0.0, 0.0, 0.0, 0.0])
    return x, t, top_p, min_p


@pytest.mark.parametrize("vocab", [QWEN_VOCAB, 1024], ids=["v151936", "v1024"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_kept_set_and_draws_equal_the_sorted_reference(vocab, dtype):
    x, t, top_p, min_p = _rows(vocab, dtype)
    p = cut.probabilities(x, t)
    want = _naive(p, top_p, min_p)
    by_torch = cut.kept(x, t, top_p, min_p)
    assert torch.equal(by_torch > 0, want)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        u = torch.rand(p.shape[0], generator=g)
        tokens, cuts, largest = cpu_ops.top_p_draw(p, top_p, min_p, u)
        got = _kept(p, cuts)
        for r in range(p.shape[0]):
            assert torch.equal(got[r], want[r]), f"row {r}: {int(got[r].sum())} kept, want {int(want[r].sum())}"
        assert tokens.tolist() == inverse_cdf(p * want, u).tolist() == inverse_cdf(by_torch, u).tolist()
        assert torch.equal(largest, p.amax(-1))
    if vocab == QWEN_VOCAB:
        assert got[4].nonzero()[:, 0].tolist() == [int(p[4].argmax())]  # top_p 1e-6: the most likely alone
        k = int(got[9].sum())  # equal logits: the lowest ids, about half of them (rounding)
        assert got[9].nonzero()[:, 0].tolist() == list(range(k)) and abs(k - vocab // 2) <= 1
        assert got[10].nonzero()[:, 0].tolist() == [77]
        assert got[11].nonzero()[:, 0].tolist() == [77]  # the tie at the cut: the lower id
        assert bool((got[7] <= (x[7] > float("-inf"))).all()) and not got[8, ::2].any()


def test_cuts_deep_in_a_tail_equal_the_pytorch_path():
    """Rows whose kept set reaches probabilities under 2^-29 (top_p near 1 or min-p's floor low),
    beside rows of other scales: the running sums are not exact there, and the operator's equal
    the PyTorch path's to the bit (the same kept set, the same token)."""
    g = torch.Generator().manual_seed(3)
    v, n = QWEN_VOCAB, 8
    x = torch.randn(n, v, generator=g)
    x[:6, :-2000] = x[:6, :-2000] * 0.1 - 13.7  # a long tail of about 3e-10 each, first in id order
    x[1::2] = x[1::2].bfloat16().float()
    x[6] *= 8.0
    t = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5])
    top_p = torch.tensor([0.99999, 0.99998, 0.99997, 0.99996, 1.0, 1.0, 0.99999994, 0.9])
    min_p = torch.tensor([0.0, 0.0, 0.0, 1e-9, 1e-9, 1e-8, 0.0, 0.0])
    p = cut.probabilities(x, t)
    by_torch = cut.kept(x, t, top_p, min_p)
    for s in range(4):
        u = torch.rand(n, generator=g)
        tokens, cuts, _ = cpu_ops.top_p_draw(p, top_p, min_p, u)
        assert torch.equal(_kept(p, cuts), by_torch > 0)
        assert tokens.tolist() == inverse_cdf(by_torch, u).tolist(), f"draw {s}"
    assert bool((cuts[:7, 0] < EXACT).all()) and cuts[7, 0] >= EXACT


def test_rows_of_nan_draw_what_the_pytorch_path_draws():
    x = torch.zeros(3, 1000)
    x[1] = float("-inf")  # every token masked: a softmax of NaN
    x[2, 5] = float("nan")
    t, top_p, min_p, u = torch.ones(3), torch.full((3,), 0.5), torch.tensor([0.0, 0.1, 0.0]), torch.full((3,), 0.3)
    tokens, _, _ = cpu_ops.top_p_draw(cut.probabilities(x, t), top_p, min_p, u)
    assert tokens.tolist() == inverse_cdf(cut.kept(x, t, top_p, min_p), u).tolist() == [150, 1000, 1000]


def test_bad_arguments_name_the_op_and_the_argument():
    p, s = torch.full((2, 8), 0.125), torch.full((2,), 0.5)
    with pytest.raises(RuntimeError, match="top_p_draw: p must be Float"):
        cpu_ops.top_p_draw(p.double(), s, s, s)
    with pytest.raises(RuntimeError, match=r"top_p_draw: min_p must be \[2\]"):
        cpu_ops.top_p_draw(p, s, s[:1], s)
    with pytest.raises(RuntimeError, match="top_p_draw: p must be"):
        cpu_ops.top_p_draw(p[0], s, s, s)

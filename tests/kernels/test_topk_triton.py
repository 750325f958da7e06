"""The sampler's small-k top-k (kernels/triton/topk.py) against `topk_reference` (a stable sort,
engine/sampling/filters.py), values and ids exactly: several blocks a row, ties planted across
block edges, rows of -inf and NaN, fewer finite values than k, bfloat16 input. Without a GPU the
kernels run under Triton's interpreter on small shapes; the `gpu` test runs Qwen's vocabulary."""

from __future__ import annotations

import pytest
import torch

from engine.sampling.filters import topk_reference
from kernels.triton.topk import TOPK_SMALL, topk_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _logits(n: int, v: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, v, generator=g) * 3).to(dtype)
    # ties: row 0 has its largest value at four ids in three blocks (block 256 below)
    x[0, [5, 250, 256, 700]] = 20.0
    # row 1: a tie across the k-th place
    x[1, [10, 300, 301]] = 15.0
    x[1, 600] = 16.0
    # row 2: all -inf but three; row 3: NaNs among the largest
    x[2] = float("-inf")
    x[2, [7, 500, 900]] = torch.tensor([1.0, 3.0, 2.0], dtype=dtype)
    x[3, [1, 2, 400]] = float("nan")
    x[3, 3] = 50.0
    return x


@pytest.mark.parametrize("k", [1, 3, 20, TOPK_SMALL])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_topk_equals_the_stable_sort(k, dtype):
    x = _logits(6, 1000, seed=k, dtype=dtype).to(DEV)
    vals, ids = topk_triton(x, k, block=256)
    rv, ri = topk_reference(x, k)
    assert vals.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids.cpu(), ri.cpu())
    assert torch.equal(vals.cpu(), rv.cpu())


def test_ties_go_to_the_lower_id_and_short_rows_fill_with_the_lowest_ids():
    x = _logits(4, 1000, seed=0).to(DEV)
    vals, ids = topk_triton(x, 5, block=256)
    assert ids[0, :4].tolist() == [5, 250, 256, 700]  # one value in three blocks
    assert ids[1, :3].tolist() == [600, 10, 300]
    assert ids[2].tolist() == [500, 900, 7, 0, 1]  # then -inf, by id
    assert vals[2, 3:].tolist() == [float("-inf")] * 2
    assert ids[3, 0].item() == 3 and not torch.isnan(vals[3]).any()  # NaN is never taken as large


def test_one_block_and_a_ragged_last_block():
    x = (torch.randn(3, 300, generator=torch.Generator().manual_seed(4)) * 3).to(DEV)
    x[1, [3, 299]] = 9.0  # a tie between the first and the last block
    for block in (512, 64):  # one block wider than the row; five, the last of 44 columns
        vals, ids = topk_triton(x, 20, block=block)
        rv, ri = topk_reference(x, 20)
        assert torch.equal(ids.cpu(), ri.cpu()) and torch.equal(vals.cpu(), rv.cpu())


@pytest.mark.parametrize("k", [1, 5, 20])
@pytest.mark.parametrize("prune", [True, False], ids=["pruned", "every-block"])
def test_many_blocks_with_and_without_the_threshold(k, prune):
    """32 blocks a row, so the threshold prunes (more blocks than k): a row's largest values all in
    one block, a tie spread over many blocks at the threshold's place, an all -inf row, NaNs."""
    g = torch.Generator().manual_seed(10 + k)
    x = torch.randn(6, 1000, generator=g) * 3
    x[0, 64:94] = torch.arange(30, dtype=torch.float32) + 40.0  # every one of the 30 largest in block 2
    x[1, ::40] = 12.0  # 25 equal values, one a block, above the rest: the threshold ties them
    x[2] = float("-inf")
    x[3, [1, 2, 400]] = float("nan")
    x[3, 999] = 50.0  # the largest in the ragged last block
    x[4, 500:520] = 7.0  # a 20-way tie in one block beside a larger value elsewhere
    x[4, 3] = 9.0
    x = x.to(DEV)
    vals, ids = topk_triton(x, k, block=32, prune=prune)
    rv, ri = topk_reference(x, k)
    assert torch.equal(ids.cpu(), ri.cpu())
    assert torch.equal(vals.cpu(), rv.cpu())


def test_bad_arguments_are_refused():
    x = torch.zeros(2, 100, device=DEV)
    with pytest.raises(ValueError, match="k must be"):
        topk_triton(x, 0)
    with pytest.raises(ValueError, match="k must be"):
        topk_triton(x, TOPK_SMALL + 1)
    with pytest.raises(ValueError, match="power of two"):
        topk_triton(x, 20, block=48)
    with pytest.raises(ValueError, match="contiguous rows"):
        topk_triton(x.t(), 2)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [20, TOPK_SMALL])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_topk_at_qwen_vocabulary_on_cuda(k, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x = _logits(64, 151_936, seed=1, dtype=dtype).cuda()
    x[5, 1000:1100] = 30.0  # a tie of 100 values in one block, above the rest of the row
    rv, ri = topk_reference(x, k)
    for prune in (True, False):
        vals, ids = topk_triton(x, k, prune=prune)
        assert torch.equal(ids, ri) and torch.equal(vals, rv), f"prune={prune}"


def test_the_fused_sampler_draws_what_the_pytorch_path_draws(monkeypatch):
    """Qwen's chat settings, a seed per row: the fused draw over this top-k's candidates picks the
    PyTorch path's tokens (random float32 logits hold no ties)."""
    from engine.sampling import Sampler
    from engine.sampling_params import SamplingParams
    from engine.step import RowInput

    chat = dict(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5)
    logits = torch.randn(8, 3000, generator=torch.Generator().manual_seed(3)) * 4

    params = [SamplingParams(**chat, seed=100 + b) for b in range(8)]

    def rows():
        return [
            RowInput(f"r{b}", [7], 40, 0, [], True, True, params=p, history=(list(range(40)), []), num_output=b)
            for b, p in enumerate(params)
        ]

    got = {}
    for fused in ("0", "1"):
        monkeypatch.setenv("PDSERVE_FORCE_TRITON", fused)
        s = Sampler(device=DEV)
        assert s.fused == (fused == "1" or DEV == "cuda")
        got[fused] = [s(logits.clone().to(DEV), rows(), list(range(8)))[0] for _ in range(3)]
    assert got["0"] == got["1"]


@pytest.mark.gpu
def test_cuda_sampler_draws_the_torch_topk_tokens(monkeypatch):
    """On CUDA both samplers above are fused, so this compares the candidates themselves: Qwen's chat
    settings at 64 x 151,936, the fused draw over this top-k against the same draw over torch.topk's
    (TOPK_SMALL at 0 sends engine/sampling/draw.py to torch.topk). Random float32 logits hold no ties
    among a row's 20 largest, where the two orders could differ."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import kernels.triton.topk as topk
    from engine.sampling import Sampler
    from engine.sampling_params import SamplingParams
    from engine.step import RowInput

    chat = dict(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5)
    params = [SamplingParams(**chat, seed=100 + b) for b in range(64)]
    gen = torch.Generator(device="cuda").manual_seed(7)
    steps = [torch.randn(64, 151_936, device="cuda", generator=gen) * 4 for _ in range(3)]

    def rows(step):
        hist = (list(range(40)), list(range(500, 500 + step)))
        return [
            RowInput(f"r{b}", [7], 40 + step, 0, [], True, True, params=p, history=hist, num_output=step)
            for b, p in enumerate(params)
        ]

    got = {}
    for small in (TOPK_SMALL, 0):
        monkeypatch.setattr(topk, "TOPK_SMALL", small)
        s = Sampler(device="cuda")
        assert s.fused, "the sampler's Triton kernels did not build on this GPU"
        got[small] = [s(x.clone(), rows(i), list(range(64)))[0] for i, x in enumerate(steps)]
    assert got[TOPK_SMALL] == got[0]

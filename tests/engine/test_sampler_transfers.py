"""How often one sampler call moves data between the host and the device, counted on the CPU
through the operators PyTorch dispatches: a tensor made from host data (`aten.lift_fresh`, what
torch.tensor, torch.as_tensor and indexing with a Python list make; a host-to-device copy on a
GPU) and every read of a tensor's values by the host (tolist, item, bool, ...). At most two
copies and one read per call, the same at batch 4 and 64: greedy, Qwen's chat settings on new
requests (whose penalty tables are built) and on running ones, and a batch mixing every option
with drafts and logprobs."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.sampling import Sampler
from engine.sampling_params import SamplingParams
from engine.step import RowInput

V = 4096  # above the sampler's head of 1024: top-p rows take the head path
QWEN = dict(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5)
READS = ("tolist", "item", "cpu", "numpy", "__int__", "__index__", "__bool__", "__float__")


class _Transfers(TorchDispatchMode):
    """Counts tensors made from host data (not 0-dim: a Python scalar in an op is a kernel
    argument or a fill on the device, not a copy) and host reads of tensor values."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[int, ...]] = []
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.lift_fresh.default and out.dim() > 0:
            self.copies.append(tuple(out.shape))
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append("scalar")
        return out

    def __enter__(self):
        self._saved = {n: getattr(torch.Tensor, n) for n in READS}
        for n, fn in self._saved.items():
            setattr(torch.Tensor, n, self._wrap(n, fn))
        return super().__enter__()

    def __exit__(self, *exc):
        for n, fn in self._saved.items():
            setattr(torch.Tensor, n, fn)
        return super().__exit__(*exc)

    def _wrap(self, name, fn):
        def read(t, *a, **kw):
            self.reads.append(name)
            return fn(t, *a, **kw)

        return read


def _rows(params, step, drafts=()):
    prompt = list(range(100, 140))
    out = list(range(500, 500 + step))
    return [
        RowInput(
            f"r{b}",
            [7, *(drafts if p.greedy else ())],
            40 + step,
            0,
            [],
            True,
            True,
            params=p,
            num_draft=len(drafts) if p.greedy else 0,
            history=(prompt, out),
            num_output=step,
        )
        for b, p in enumerate(params)
    ]


def _mixed(b: int) -> SamplingParams:
    return [
        SamplingParams(temperature=0.0),
        SamplingParams(**QWEN, seed=1000 + b),
        SamplingParams(**QWEN),
        SamplingParams(temperature=0.9, top_p=0.95, seed=b),
        SamplingParams(temperature=1.0, min_p=0.1, seed=b, logprobs=3),
        SamplingParams(temperature=0.8, frequency_penalty=0.5, repetition_penalty=1.2, seed=b),
        SamplingParams(temperature=1.0, logit_bias={11: 5.0, 12: -100.0}, min_tokens=8, seed=b),
        SamplingParams(temperature=1.3, top_k=2000, seed=b),
        SamplingParams(temperature=1.1, seed=b),
    ][b % 9]


CASES = {
    "greedy": lambda b: SamplingParams(temperature=0.0),
    "qwen_chat_seeded": lambda b: SamplingParams(**QWEN, seed=1000 + b),
    "top_p_alone": lambda b: SamplingParams(temperature=0.8, top_p=0.95, seed=b),
    "mixed": _mixed,
}


def _count(batch: int, make, drafts=()) -> list[tuple[int, int]]:
    """(copies, reads) of the first call (new requests) and of a second (running ones)."""
    params = [make(b) for b in range(batch)]
    sampler = Sampler(seed=1, eos_token_ids=(2,))
    gen = torch.Generator().manual_seed(batch)
    got = []
    for step in range(2):
        rows = _rows(params, step, drafts)
        n = sum(r.num_draft + 1 for r in rows)
        logits = torch.randn(n, V, generator=gen) * 4  # peaked: each top-p row's kept set is in its head
        first = [sum(r.num_draft + 1 for r in rows[:i]) for i in range(len(rows))]
        with _Transfers() as t:
            sampler(logits, rows, first)
        got.append((len(t.copies), len(t.reads)))
    return got


@pytest.mark.parametrize("case", CASES, ids=CASES.keys())
def test_two_copies_one_read_per_call_at_any_batch(case):
    small, large = _count(4, CASES[case]), _count(64, CASES[case])
    assert small == large, f"batch 4 {small}, batch 64 {large}"
    for copies, reads in large:
        assert copies <= 2 and reads == 1, large
    if case == "greedy":
        assert large == [(0, 1), (0, 1)]


def test_drafts_and_logprobs_in_the_same_read():
    got = _count(18, _mixed, drafts=(5, 6, 7))
    assert all(c <= 2 and r == 1 for c, r in got), got


def test_flat_top_p_rows_pay_a_second_read_only_when_the_head_misses():
    """A top-p row whose 1024 most likely tokens hold less than top_p is drawn again over its
    sorted row: a second upload and read, for that call only."""
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=b) for b in range(8)]
    sampler = Sampler()
    with _Transfers() as t:
        sampler(torch.randn(8, V) * 0.05, _rows(params, 0), list(range(8)))
    assert (len(t.copies), len(t.reads)) == (4, 2)
    with _Transfers() as t:
        sampler(torch.randn(8, V) * 4, _rows(params, 1), list(range(8)))
    assert (len(t.copies), len(t.reads)) == (0, 1)  # the same rows a token on: the first call's plan

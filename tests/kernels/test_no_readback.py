"""Given the longest row (`max_len`, which the engine knows on the host), the Triton wrappers read
nothing back from the device: on a GPU each read waits for the queued work, so a decode step
would stall once per kernel call (kernels/checks.py). Counted here by wrapping the tensor methods
that copy a value to the host, for calls made from pdserve's own modules; without `max_len` the
same calls do read (the count is not vacuous). Tiny shapes under the interpreter."""

from __future__ import annotations

import sys
from contextlib import contextmanager

import pytest
import torch

from tests.helpers.kernel_cases import conv_case, gdn_case
from tests.kernels.test_attention import make_case as attention_case

READS = ("tolist", "item", "__int__", "__index__", "__bool__", "__float__")


@contextmanager
def host_reads():
    """Collects (method, module, line) of each tensor-to-host read made by kernels.* / engine.* code."""
    calls: list[tuple[str, str, int]] = []
    saved = {n: getattr(torch.Tensor, n) for n in READS}

    def wrap(name, fn):
        def read(self, *a, **kw):
            f = sys._getframe(1)
            mod = f.f_globals.get("__name__", "")
            if mod.startswith(("kernels", "engine")):
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


LENS = [5, 1, 9]


def _gdn_chunk(max_len):
    from kernels.triton.gdn_chunk import gdn_chunk_prefill_triton

    c = gdn_case(LENS, (2, 4, 16, 16), torch.float32, seed=1)
    gdn_chunk_prefill_triton(*c.args(), c.pool, c.slots, c.has_init, chunk_size=16, max_len=max_len)


def _gdn_recurrent(max_len):
    from kernels.triton.gdn_recurrent import gdn_recurrent_triton

    c = gdn_case(LENS, (2, 4, 16, 16), torch.float32, seed=2)
    gdn_recurrent_triton(*c.args(), c.pool, c.slots, c.has_init, max_len=max_len)


def _conv(max_len):
    from kernels.triton.conv import causal_conv1d_triton

    x, w, cu, pool, slots, _, has_init = conv_case(LENS, 32, torch.float32, seed=3)
    causal_conv1d_triton(x, w, cu, pool, slots, has_init, max_len=max_len)


def _attention(max_len):
    from kernels.triton.paged_attention import paged_attention_triton

    q, pool, _, cu, seq_lens, tables = attention_case([(n, n + 7) for n in LENS], (4, 2), torch.float32)
    paged_attention_triton(q, pool, cu, seq_lens, tables, 0.25, max_len=max_len)


@pytest.mark.parametrize("op", [_gdn_chunk, _gdn_recurrent, _conv, _attention], ids=lambda f: f.__name__[1:])
def test_known_lengths_read_nothing_back(op):
    with host_reads() as calls:
        op(max(LENS))
    assert calls == []
    with host_reads() as calls:
        op(None)
    assert calls  # the lengths read from cu_seqlens


def test_conv_update_reads_nothing_back():
    from kernels.triton.conv import causal_conv1d_update_triton

    x, w, _, pool, slots, _, _ = conv_case([1, 1, 1], 32, torch.float32, seed=4)
    with host_reads() as calls:
        causal_conv1d_update_triton(x, w, pool, slots)
    assert calls == []


def test_small_topk_reads_nothing_back():
    from kernels.triton.topk import topk_triton

    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(5))
    with host_reads() as calls:
        topk_triton(x, 4, block=64)
    assert calls == []

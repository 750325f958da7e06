"""--batch-invariant on CUDA (needs a GPU): a bfloat16 request's tokens and log-probabilities are
the same bits alone, with its prompt in chunks, resumed from prompt + output (a moved request)
and beside other requests, as tests/engine/test_batch_invariant.py holds the CPU to; dense and
MoE, prefix caching on (snapshots inside prompt chunks take the recurrent GDN prefill's phases).
The mode is off on CUDA unless asked for (checked without a GPU)."""

from __future__ import annotations

import pytest

from engine.config import EngineArgs
from tests.engine.test_batch_invariant import same_bits_every_way
from tests.helpers import hybrid_ckpt as hc


@pytest.mark.gpu
@pytest.mark.timeout(900)
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
@pytest.mark.parametrize("model", ["dense", "moe"])
def test_bf16_request_is_the_same_bits_on_cuda(model, prefix_caching, request):
    ckpt = request.getfixturevalue("ckpt_bf16" if model == "dense" else "ckpt_moe")
    vocab = 1024 if model == "dense" else hc.SPEC_MOE["qwen3_5_moe"].vocab
    kw = dict(dtype="bfloat16", device="cuda", engine_process=False, batch_invariant=True)
    same_bits_every_way(ckpt, vocab, kw | dict(enable_prefix_caching=prefix_caching))


def test_batch_invariant_is_off_on_cuda_unless_asked_for(ckpt_bf16):
    def resolved(**kw) -> bool:
        return EngineArgs(ckpt_bf16, device="cuda", dtype="bfloat16", **kw).engine_config().model.batch_invariant

    assert resolved() is False
    assert resolved(batch_invariant=True) is True

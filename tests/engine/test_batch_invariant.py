"""--batch-invariant in bfloat16 (on by default on a CPU with AVX512-BF16): a request's tokens and log-probabilities are the same bits
whether its prompt is prefilled whole or in chunks, whether it is resumed from prompt + output
(a request moved to another node), and whatever else shares its steps; and they stay within the
bound tests/engine/test_bf16.py holds the engine to against transformers' bfloat16 forward."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.config import EngineArgs
from engine.model.linear import Linear, row_invariant
from engine.options import add_options, options, values
from kernels import cpu_ops
from kernels.moe import fused_moe, select_experts
from tests.engine.test_bf16 import TOL
from tests.helpers import hybrid_ckpt as hc

pytestmark = pytest.mark.skipif(not cpu_ops.available(torch.bfloat16), reason="the CPU operators are not built")

NEW, HALF = 24, 12


def test_row_invariant_linear_gives_each_row_the_same_bits_at_any_row_count():
    g = torch.Generator().manual_seed(0)
    for n, k in ((256, 512), (300, 2048), (40, 7)):
        w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
        lin = row_invariant(Linear(w))
        assert torch.equal(lin.weight, w)
        x = torch.randn(300, k, generator=g).bfloat16()
        whole = lin(x)
        # the reference: exact products summed in float64; the float32 sum's error (at most K
        # roundings of the running sum) then one rounding to bfloat16 (the exact bits:
        # tests/kernels/test_gemm_bf16.py)
        ref = F.linear(x.double(), w.double())
        bound = F.linear(x.double().abs(), w.double().abs()) * k * 2.0**-24
        step = (ref.abs() + bound).log2().floor().exp2() * 2.0**-8
        assert whole.dtype == torch.bfloat16
        assert bool(((whole.double() - ref).abs() <= step + bound).all())
        for rows in (1, 2, 5, 7, 12, 13, 64):
            for start in (0, 3, 300 - rows):
                assert torch.equal(lin(x[start : start + rows]), whole[start : start + rows]), (n, k, rows, start)


@pytest.mark.parametrize("H,I,E,k", [(512, 256, 8, 2), (1024, 128, 8, 4)])
def test_row_invariant_experts_give_each_token_the_same_bits_in_any_batch(H, I, E, k):
    """The routed experts with row_invariant: a token's output is the same bits in a batch of
    96, in slices of 7 and alone (oneDNN's and the float32 copies' sums change with the rows an
    expert gets, at these shapes), and within bfloat16 rounding of a float64 per-token loop."""
    g = torch.Generator().manual_seed(H + k)
    x = torch.randn(96, H, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.05).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * 0.05).bfloat16()
    tw, ti = select_experts(torch.randn(96, E, generator=g), k, True)
    whole = fused_moe(x, w13, w2, tw, ti, row_invariant=True)
    for s in range(0, 96, 7):
        assert torch.equal(
            fused_moe(x[s : s + 7], w13, w2, tw[s : s + 7], ti[s : s + 7], row_invariant=True), whole[s : s + 7]
        )
    for i in (0, 41, 95):
        assert torch.equal(
            fused_moe(x[i : i + 1], w13, w2, tw[i : i + 1], ti[i : i + 1], row_invariant=True), whole[i : i + 1]
        )
    ref = torch.zeros(96, H, dtype=torch.float64)
    for t_ in range(96):
        for j in range(k):
            e = int(ti[t_, j])
            h = x[t_].double() @ w13[e].double().T
            ref[t_] += float(tw[t_, j]) * ((F.silu(h[:I]) * h[I:]) @ w2[e].double().T)
    assert float((whole.double() - ref).abs().max()) <= 0.02 * float(ref.abs().max())


def _run(core, jobs, logprobs: int | None = 5, new: int = NEW) -> list[tuple[list[int], list]]:
    """jobs: (prompt, output so far or None, engine steps to run before adding it) -> each job's
    (new tokens, their logprobs) once every job has finished (logprobs=None: the tokens alone)."""
    sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    rids: dict[int, str] = {}
    got: dict[str, tuple[list[int], list]] = {}
    finished: set[str] = set()
    step = 0
    while len(finished) < len(jobs):
        for i, (prompt, out, at) in enumerate(jobs):
            if at == step:
                rids[i] = core.add_request(prompt, sp) if out is None else core.resume_request(prompt, sp, out)
                got[rids[i]] = ([], [])
        for o in core.step():
            got[o.request_id][0].extend(o.new_token_ids)
            got[o.request_id][1].extend(o.logprobs or [])
            if o.finished:
                finished.add(o.request_id)
        step += 1
    return [got[rids[i]] for i in range(len(jobs))]


def same_bits_every_way(ckpt: str, vocab: int, kw: dict) -> tuple[list[int], list[int]]:
    """Engines with `kw` (one with chunks of 16): a request's tokens and logprobs are the same bits
    whole, chunked, resumed or batched. Returns (its prompt, its tokens)."""
    prompts = hc.prompts(vocab, lens=(40, 100, 7, 63, 130), seed=5)
    target = prompts[1]
    with LLM(ckpt, **kw) as llm, LLM(ckpt, max_num_batched_tokens=16, batch_chunk_tokens=16, **kw) as small:
        core, chunked = llm.engine, small.engine
        assert core is not None and chunked is not None
        alone = _run(core, [(target, None, 0)])[0]
        toks, lps = alone
        assert len(toks) == NEW and len(lps) == NEW
        cont = (toks[HALF:], lps[HALF:])
        # resumed from the first half of its output: one prefill of prompt + output, then decode
        assert _run(core, [(target, toks[:HALF], 0)])[0] == cont
        # its prompt in chunks of 16, alone and resumed
        assert _run(chunked, [(target, None, 0)])[0] == alone
        assert _run(chunked, [(target, toks[:HALF], 0)])[0] == cont
        # beside others: its prefill sharing steps with their decode rows, its decode with their prefills
        others = [(p, None, 0) for p in prompts[:1] + prompts[2:3]] + [(p, None, 3) for p in prompts[3:]]
        assert _run(core, [(target, None, 2), *others])[0] == alone
        assert _run(chunked, [*others, (target, toks[:HALF], 1)])[-1] == cont
        assert core.blocks.num_free == llm.capacity().num_blocks
    return target, toks


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_bf16_request_is_the_same_bits_whole_chunked_resumed_or_batched(model, request):
    """Dense, and MoE: the routed experts' rows differ with the batch, and each expert's GEMV
    gives a row the same sums whatever the number of rows it shares the expert with."""
    ckpt_bf16 = request.getfixturevalue("ckpt_bf16" if model == "dense" else "ckpt_moe")
    vocab = 1024 if model == "dense" else hc.SPEC_MOE["qwen3_5_moe"].vocab
    kw = dict(dtype="bfloat16", engine_process=False, enable_prefix_caching=False, batch_invariant=True)
    target, toks = same_bits_every_way(ckpt_bf16, vocab, kw)
    # and the tokens are transformers' bfloat16 argmax but for near-ties (the bound of test_bf16.py)
    short = hc.hf_logit_shortfall(ckpt_bf16, target, toks, dtype=torch.bfloat16)
    assert float(short.max()) <= TOL, short.tolist()


_DRAFT_PROMPTS = hc.prompts(lens=(40, 33, 57, 21), seed=3)


@pytest.fixture(scope="module")
def ckpt_drafts(tmp_path_factory):
    """An MTP block fitted to the drafts test's prompts, so drafts are accepted as well as rolled back."""
    return hc.make_fitted_mtp(tmp_path_factory.mktemp("bf16inv-mtp") / "ckpt", hc.SPEC_MTP, _DRAFT_PROMPTS, length=200)


def test_bf16_drafts_keep_the_same_bits(ckpt_drafts):
    """With MTP drafts each request's tokens are the same alone, added while the others decode
    with drafts (its prompt in a step beside drafted rows), resumed from half its output, and as
    without drafts: verification computes each token as a decode row does."""
    kw = dict(dtype="bfloat16", engine_process=False, enable_prefix_caching=False, batch_invariant=True)
    seen: dict[int, list] = {}
    for k in (0, 2):
        with LLM(ckpt_drafts, num_speculative_tokens=k, speculative_method="mtp", **kw) as llm:
            core = llm.engine
            assert core is not None
            for t in _DRAFT_PROMPTS:
                alone = _run(core, [(t, None, 0)], None, 64)[0][0]
                beside = [(t, None, 2)] + [(p, None, i) for i, p in enumerate(_DRAFT_PROMPTS) if p is not t]
                assert _run(core, beside, None, 64)[0][0] == alone, (k, t[:3])
                assert _run(core, [(t, alone[:32], 0)], None, 64)[0][0] == alone[32:], (k, t[:3])
                seen.setdefault(k, []).append(alone)
            if k:
                assert core.scheduler.num_accepted_tokens > 0, "no draft was accepted: the accept path did not run"
    assert seen[2] == seen[0]


def test_bf16_mtp_prompt_in_chunks_keeps_the_same_bits(ckpt_drafts, monkeypatch):
    """MTP drafting wants every prompt token's hidden state, so a prompt chunk that is not the last
    one has no logits rows. On two threads, with every projection split over them (as Qwen's
    151,936-row head is), its head's GEMM over no rows once trapped (SIGILL, the prefill node
    gone); the head is now skipped there, and the GEMM itself takes no rows
    (tests/kernels/test_cpu_ops_boundary.py). Prompts in chunks of 16 with MTP drafts give the
    tokens of whole prompts without drafts."""
    import engine.model.linear as linear

    monkeypatch.setattr(linear, "_GEMV_THREADED", 1)  # every weight counts as one to split
    kw = dict(dtype="bfloat16", engine_process=False, enable_prefix_caching=False, batch_invariant=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = {}
        for k, chunk in ((0, {}), (2, dict(max_num_batched_tokens=16, batch_chunk_tokens=16))):
            with LLM(ckpt_drafts, num_speculative_tokens=k, speculative_method="mtp", **chunk, **kw) as llm:
                core = llm.engine
                assert core is not None
                got[k] = [_run(core, [(t, None, 0)], None, 32)[0][0] for t in _DRAFT_PROMPTS]
                if k:
                    assert core.scheduler.num_accepted_tokens > 0, "no draft was accepted"
    finally:
        torch.set_num_threads(threads)
    assert got[2] == got[0]


def test_bfloat16_on_the_cpu_is_batch_invariant_unless_turned_off(ckpt_bf16, monkeypatch):
    """Unset, the option resolves on for bfloat16 on the CPU with the C operators, AVX512-BF16 or
    not (the float32 multiply-adds give the same bits), and off where the mode does not apply
    (float32 needs no help; a bfloat16 GDN state it does not cover; no C operators); given, it is
    what was given."""

    def resolved(**kw) -> bool:
        return EngineArgs(ckpt_bf16, **kw).engine_config().model.batch_invariant

    assert resolved(dtype="bfloat16") is True
    assert resolved(dtype="bfloat16", batch_invariant=False) is False
    assert resolved(dtype="float32") is False
    assert resolved(dtype="float32", batch_invariant=True) is True
    assert resolved(dtype="bfloat16", mamba_ssm_cache_dtype="bfloat16") is False
    monkeypatch.setattr(cpu_ops, "bf16_dot_supported", lambda: False)  # as on a CPU without AVX512-BF16
    assert resolved(dtype="bfloat16") is True
    monkeypatch.setattr(cpu_ops, "available", lambda dtype=None: False)  # the C operators not built
    assert resolved(dtype="bfloat16") is False
    assert resolved(dtype="bfloat16", batch_invariant=True) is True
    parser = argparse.ArgumentParser()
    add_options(parser, options(EngineArgs))
    assert values(options(EngineArgs), parser.parse_args(["--no-batch-invariant"]))["batch_invariant"] is False
    assert values(options(EngineArgs), parser.parse_args([]))["batch_invariant"] is None


def test_batch_invariant_refuses_what_it_does_not_cover(ckpt_bf16, ckpt_moe):
    with pytest.raises(ValueError, match="batch-invariant experts run contiguous bfloat16 weights"):
        with LLM(ckpt_moe, dtype="float32", engine_process=False, batch_invariant=True) as llm:
            llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="float32 GDN state"):
        LLM(ckpt_bf16, dtype="bfloat16", engine_process=False, batch_invariant=True, mamba_ssm_cache_dtype="bfloat16")

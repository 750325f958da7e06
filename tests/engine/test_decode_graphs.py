"""Decode steps through engine/model/graphs.py give the tokens of plain eager steps. On the CPU the
graph buffers alone are checked (every covered step copies its inputs into the size's buffers and
runs eagerly on them: the copying, the wider block tables, batch sizes that come back); on CUDA
the captured graphs are replayed (gpu). Requests of different lengths finish at different steps,
so the batch size shrinks and sizes recur."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.graphs import DecodeGraphs, _Buffers, plain_decode
from tests.helpers import hybrid_ckpt as hc
from tests.helpers.decode_batch import assert_same_decode_batch


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return hc.make(tmp_path_factory.mktemp("graphs") / "ckpt", hc.SPEC_HV2)


def _params(n: int, sampled: bool) -> list[SamplingParams]:
    if sampled:
        return [
            SamplingParams(max_tokens=6 + 3 * i, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True) for i in range(n)
        ]
    return [SamplingParams(max_tokens=6 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(n)]


def _run(path, device, dtype, graphs: str, sampled: bool):
    prompts = hc.prompts()[:5]
    with LLM(path, dtype=dtype, device=device, enable_prefix_caching=False) as llm:
        w = llm.engine.executor.worker
        if graphs == "buffers":
            w.graphs = DecodeGraphs(w.model, w.pools, w.max_pages_per_row(), capture=False)
        elif graphs == "off":
            w.graphs = None
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=_params(len(prompts), sampled))
        return [o.output_token_ids for o in outs], w.graphs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_buffers_give_eager_tokens_on_cpu(ckpt, dtype, sampled):
    ref, _ = _run(ckpt, "cpu", dtype, "off", sampled)
    got, g = _run(ckpt, "cpu", dtype, "buffers", sampled)
    assert got == ref
    assert g.covered >= 10 and len(g.sizes) >= 3  # decode steps at several batch sizes went through
    assert all(x.buffers.flat is not None for x in g.sizes.values())  # every one staged in place


def test_staged_batch_equals_the_general_one(ckpt):
    """`stage` writes a plain decode step into its size's buffers; each field equals what the
    worker's general path builds from the same rows."""
    params = _params(4, sampled=False)
    with LLM(ckpt, dtype="float32", enable_prefix_caching=False, engine_process=False) as llm:
        eng = llm.engine
        w = eng.executor.worker
        w.graphs = None
        for p, prompt in zip(params, hc.prompts()[:4]):
            eng.add_request(prompt, p)
        seen = []
        real = w.build_batch

        def both(step):  # staged first: the page tables it grows are written by the general path after
            g = DecodeGraphs(w.model, w.pools, w.max_pages_per_row(), capture=False)
            staged = g.stage(step.rows, w.block_tables, w.block_size) if plain_decode(step.rows) else None
            if staged is not None:  # the packed page tables into the kernels' [rows, max pages], as a replay does
                g.sizes[len(step.rows)].buffers.expand()
            general = real(step)
            seen.append((general, staged))
            return general

        w.build_batch = both
        for _ in range(8):
            eng.step()
    pairs = [(a, b) for a, b in seen if b is not None]
    assert len(pairs) >= 5
    for a, b in pairs:
        assert_same_decode_batch(a, b)
        w_ = a.decode.block_tables.shape[1]
        # a batch built the general way, loaded into a staged size's buffers, reads the same tables
        other = _Buffers.staged(a.decode.num_rows, b.decode.block_tables.shape[1], torch.device("cpu"))
        other.load(a)
        other.expand()
        assert torch.equal(a.decode.block_tables, other.batch.decode.block_tables[:, :w_])
        assert torch.equal(a.input_ids, other.batch.input_ids)


def test_other_steps_are_not_covered(ckpt):
    with LLM(ckpt, dtype="float32", enable_prefix_caching=False) as llm:
        w = llm.engine.executor.worker
        g = DecodeGraphs(w.model, w.pools, w.max_pages_per_row(), capture=False)
        w.graphs = g
        llm.generate(prompt_token_ids=[hc.prompts()[0]], sampling_params=SamplingParams(max_tokens=1))
        assert g.covered == 0  # a prefill step (its one token comes from the prompt's last position)


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_graph_replay_gives_eager_tokens_on_cuda(ckpt, sampled):
    ref, _ = _run(ckpt, "cuda", "bfloat16", "off", sampled)
    got, g = _run(ckpt, "cuda", "bfloat16", "on", sampled)
    assert g is not None and not g.failed, f"capture failed at batch sizes {sorted(g.failed)}"
    assert g.replays > 0
    assert got == ref
    assert torch.cuda.is_available()

"""Decode steps padded to CUDA-graph batch sizes (engine/model/graphs.py, `buckets`): a step of n
rows runs in the smallest bucket of at least n, its other rows padding that write the pools'
padding slot and page (Capacity.padding). On the CPU the buffers alone are run (capture off, the
CUDA path's staging and spreading): every padded batch's first rows equal the worker's general
batch, field by field, also when a steady step moves the last one on; the padding rows point at
the padding slot and page only; tokens equal those of unpadded eager steps, greedy and sampled,
in float32 and bfloat16; the counted slots and pages are what the scheduler had."""

from __future__ import annotations

import dataclasses

import pytest

from engine import LLM, SamplingParams
from engine.cache.allocator import CachePools, plan_capacity
from engine.model.graphs import DecodeGraphs, decode_buckets
from tests.helpers import hybrid_ckpt as hc
from tests.helpers.decode_batch import assert_same_decode_batch

BUCKETS = (2, 4, 8)  # five requests that finish at different steps: 5 -> 8, 4, 3 -> 4, 2, 1 -> 2


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return hc.make(tmp_path_factory.mktemp("padded") / "ckpt", hc.SPEC_HV2)


def _params(sampled: bool) -> list[SamplingParams]:
    kw = dict(temperature=0.8, top_p=0.9) if sampled else dict(temperature=0.0)
    return [SamplingParams(max_tokens=6 + 5 * i, seed=i, ignore_eos=True, **kw) for i in range(5)]


def _padded(w) -> DecodeGraphs:
    """The worker's pools again with the padding slot and page, and padded graph buffers over them."""
    w.pools = CachePools(w.specs, dataclasses.replace(w.capacity, padding=1), w.device)
    g = DecodeGraphs(w.model, w.pools, w.max_pages_per_row(), capture=False, buckets=BUCKETS)
    g.capture_all(w.block_size)  # padding rows alone, once per size
    return g


def _run(path, dtype: str, padded: bool, sampled: bool, check=None):
    with LLM(path, dtype=dtype, block_size=4, enable_prefix_caching=False, engine_process=False) as llm:
        w = llm.engine.executor.worker
        w.graphs = _padded(w) if padded else None
        if check is not None:
            check(w)
        outs = llm.generate(prompt_token_ids=hc.prompts()[:5], sampling_params=_params(sampled))
        return [o.output_token_ids for o in outs], w


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_padded_steps_give_eager_tokens(ckpt, dtype, sampled):
    ref, _ = _run(ckpt, dtype, False, sampled)
    got, w = _run(ckpt, dtype, True, sampled)
    assert got == ref
    g = w.graphs
    assert g.covered >= 20 and set(g.sizes) == set(BUCKETS)
    slot, page = w.pools.pad
    assert any(bool(t[slot].abs().sum()) for t in w.pools.recurrent.values())  # the padding rows ran


def test_padded_batches_equal_the_general_ones(ckpt):
    seen = {"padded": 0, "advanced": 0}

    def check(w):
        g, general = w.graphs, w.build_batch
        slot, page = w.pools.pad
        real_advance = g._advance

        def advance(*a):
            seen["advanced"] += a[0].size > len(a[1])
            return real_advance(*a)

        g._advance = advance

        def both(step):
            staged = g.stage(step.rows, w.block_tables, w.block_size, step.steady) if step.plain else None
            w.graphs = None
            ref = general(step)
            w.graphs = g
            if staged is None:
                g.last_staged = None
                return ref
            n, size = len(step.rows), staged.input_ids.numel()
            assert size == min(b for b in BUCKETS if b >= n)
            g.sizes[size].buffers.expand()
            first = dataclasses.replace(
                staged,
                input_ids=staged.input_ids[:n],
                positions=staged.positions[:n],
                slot_mapping=staged.slot_mapping[:n],
                logits_indices=staged.logits_indices[:n],
                decode=dataclasses.replace(
                    staged.decode,
                    cu_seqlens=staged.decode.cu_seqlens[: n + 1],
                    slot_ids=staged.decode.slot_ids[:n],
                    has_initial_state=staged.decode.has_initial_state[:n],
                    seq_lens=staged.decode.seq_lens[:n],
                    block_tables=staged.decode.block_tables[:n],
                ),
            )
            assert_same_decode_batch(ref, first)
            if size > n:
                seen["padded"] += 1
                d = staged.decode
                assert staged.input_ids[n:].eq(0).all() and staged.positions[n:].eq(0).all()
                assert d.slot_ids[n:].eq(slot).all() and d.seq_lens[n:].eq(1).all()
                assert staged.slot_mapping[n:].eq(page * w.block_size).all()
                assert d.block_tables[n:, 0].eq(page).all()
            return staged

        w.build_batch = both

    _run(ckpt, "float32", True, False, check)
    assert seen["padded"] >= 10 and seen["advanced"] >= 5, seen


def test_the_counted_slots_and_pages_leave_out_the_padding(ckpt):
    with LLM(ckpt, dtype="float32", enable_prefix_caching=False, engine_process=False) as llm:
        w = llm.engine.executor.worker
        cap = plan_capacity(w.specs, w.capacity.cache_bytes, w.capacity.num_state_slots, w.capacity.block_size)
        padded = plan_capacity(w.specs, cap.cache_bytes, cap.num_state_slots, cap.block_size, padding=1)
        pools = CachePools(w.specs, padded, w.device)
    # the budget pays for the padding slot and page
    slot_bytes, page_bytes = cap.state_bytes // cap.num_state_slots, cap.kv_bytes_per_token * cap.block_size
    assert padded.num_state_slots == cap.num_state_slots
    assert padded.num_blocks == (cap.cache_bytes - cap.state_bytes - slot_bytes - page_bytes) // page_bytes
    assert pools.pad == (padded.num_state_slots, padded.num_blocks)
    for t in pools.recurrent.values():
        assert t.shape[0] == padded.num_state_slots + 1
    for t in pools.kv.values():
        assert t.shape[0] == padded.num_blocks + 1
    used = sum(
        t.numel() * t.element_size() for t in [*pools.kv.values(), *pools.conv.values(), *pools.recurrent.values()]
    )
    assert used <= cap.cache_bytes


def test_buckets():
    assert decode_buckets(1) == (1,)
    assert decode_buckets(6) == (1, 2, 4, 6)
    b = decode_buckets(256)
    assert b[:4] == (1, 2, 4, 8) and b[-1] == 256 and list(b) == sorted(set(b))
    pad = {n: min(x for x in b if x >= n) - n for n in range(1, 257)}
    assert max(pad[n] for n in range(1, 65)) == 7 and max(pad.values()) == 31 and pad[129] == 31
    assert max(pad[n] for n in range(65, 129)) == 15
    with pytest.raises(ValueError, match="padding slot and page"):
        DecodeGraphs(None, CachePools([], dataclasses.replace(_cap(), padding=0)), 4, capture=False, buckets=(2,))


def _cap():
    from engine.cache.allocator import Capacity

    return Capacity(0, 0, 0, 1, 4, 0, 1)


def test_cuda_graphs_option(ckpt, monkeypatch):
    """--no-cuda-graphs (LLM(cuda_graphs=False)) reaches the engine config, and graphs are wanted on
    CUDA at TP 1 only, unless it or PDSERVE_CUDA_GRAPHS=0 turns them off."""
    import torch

    from engine.config import EngineArgs
    from engine.model.graphs import graphs_wanted
    from router.cli import build_parser

    monkeypatch.delenv("PDSERVE_CUDA_GRAPHS", raising=False)
    cuda = torch.device("cuda")
    assert graphs_wanted(cuda, 1) and not graphs_wanted(cuda, 1, on=False)
    assert not graphs_wanted(cuda, 2) and not graphs_wanted(torch.device("cpu"), 1)
    monkeypatch.setenv("PDSERVE_CUDA_GRAPHS", "0")
    assert not graphs_wanted(cuda, 1)
    assert EngineArgs(model=ckpt).engine_config().cuda_graphs is True
    assert EngineArgs(model=ckpt, cuda_graphs=False).engine_config().cuda_graphs is False
    args = build_parser().parse_args(["decode", "--model", ckpt, "--no-cuda-graphs"])
    assert args.cuda_graphs is False

"""transfer.plan against a brute-force gather/scatter through the global layout, for every
(a, b) in {1, 2, 4}^2, with Hv = Hk and Hv = 2 Hk, and KVH = 1, 2, 4 (replicated KV heads)."""

from __future__ import annotations

import itertools

import msgspec
import numpy as np
import pytest
import torch

from tests.helpers.xfer_state import engine_cfg, global_state, make_pools, noise, place, snapshot, tiny_model
from transfer.errors import PlanError
from transfer.plan import pair_templates, plan, plan_nbytes, sources_for
from transfer.schema import build_schema

TOKENS = 15  # 4 blocks of 4, the last one partly filled
SRC_BLOCKS = [6, 7, 8, 2]  # partly consecutive: some ranges coalesce, some do not
DST_BLOCKS = [1, 2, 3, 9]
SRC_SLOT, DST_SLOT = 2, 1

CASES = [
    pytest.param(hk, hv, kvh, a, b, id=f"Hk{hk}-Hv{hv}-KVH{kvh}-tp{a}to{b}")
    for (hk, hv) in ((4, 4), (4, 8))
    for kvh in (1, 2, 4)
    for a, b in itertools.product((1, 2, 4), repeat=2)
]


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


@pytest.mark.parametrize("hk,hv,kvh,a,b", CASES)
def test_plan_matches_global_reshard(hk, hv, kvh, a, b):
    model = tiny_model(hk=hk, hv=hv, kvh=kvh)
    src_cfg, dst_cfg = engine_cfg(model, a), engine_cfg(model, b, memory="128KiB")
    state = global_state(model, TOKENS, 4, seed=a * 10 + b)
    src_pools = [make_pools(src_cfg, r) for r in range(a)]
    dst_pools = [make_pools(dst_cfg, r) for r in range(b)]
    for r, p in enumerate(src_pools):
        noise(p, seed=100 + r)
        place(p, src_cfg, r, state, SRC_BLOCKS, SRC_SLOT)
    expected = []
    for r, p in enumerate(dst_pools):
        noise(p, seed=200 + r)
        exp = make_pools(dst_cfg, r)
        noisy = snapshot(p)
        for kind, layer, t in exp.tensors():
            t.copy_(noisy[(kind, layer)])
        place(exp, dst_cfg, r, state, DST_BLOCKS, DST_SLOT)
        expected.append(snapshot(exp))

    src_s = [build_schema(src_cfg, r, p) for r, p in enumerate(src_pools)]
    dst_s = [build_schema(dst_cfg, r, p) for r, p in enumerate(dst_pools)]
    for rd, (dp, ds) in enumerate(zip(dst_pools, dst_s)):
        dst_regions = {(kind, layer): _bytes(t) for kind, layer, t in dp.tensors()}
        writes = {k: np.zeros(v.shape, dtype=np.int32) for k, v in dst_regions.items()}
        senders = 0
        for sp, ss in zip(src_pools, src_s):
            src_regions = {(kind, layer): _bytes(t) for kind, layer, t in sp.tensors()}
            ranges = plan(ss, ds, SRC_BLOCKS, DST_BLOCKS, SRC_SLOT, DST_SLOT)
            assert plan_nbytes(pair_templates(ss, ds), len(SRC_BLOCKS)) == sum(r.length for r in ranges)
            senders += bool(ranges)
            for layer, kind, so, do, n in ranges:
                dst_regions[(kind, layer)][do : do + n] = src_regions[(kind, layer)][so : so + n]
                writes[(kind, layer)][do : do + n] += 1
        for key, w in writes.items():
            assert w.max() <= 1, f"dst rank {rd} {key}: a byte is written by two sources"
        for kind, layer, t in dp.tensors():
            e = expected[rd][(kind, layer)]
            same = torch.equal(t.reshape(-1).view(torch.uint8), e.reshape(-1).view(torch.uint8))
            assert same, f"tp {a}->{b}: dst rank {rd} {kind} layer {layer} differs from the re-sharded global state"
        assert sources_for(src_s, ds) == [r for r in range(a) if pair_templates(src_s[r], ds)]
        assert senders == len(sources_for(src_s, ds))


def _schemas(model, tp: int) -> list:
    cfg = engine_cfg(model, tp)
    return [build_schema(cfg, r, make_pools(cfg, r)) for r in range(tp)]


def _kv_ranges(s, d, src_blocks, dst_blocks) -> list:
    return [r for r in plan(s, d, src_blocks, dst_blocks, 0, 1) if r.kind == "paged_kv"]


@pytest.mark.parametrize("a,b", [(1, 1), (2, 1), (1, 2), (2, 2)], ids=lambda n: f"tp{n}")
def test_plan_consecutive_blocks_one_range_per_layer_and_head(a, b):
    """Blocks consecutive on both sides: one range per (layer, KV head) for every TP pair, since
    KV pools are head-major (a head's K and V of a run of blocks is contiguous on each side)."""
    model = tiny_model(hk=4, hv=8, kvh=2)
    src, dst = _schemas(model, a), _schemas(model, b)
    total = 0
    for d in dst:
        for s in src:
            ranges = _kv_ranges(s, d, [3, 4, 5, 6], [10, 11, 12, 13])
            expected = []
            for layer in model.attention_layers:
                st, dt = s.tensor(layer, "paged_kv"), d.tensor(layer, "paged_kv")
                page = st.page_stride
                assert page == dt.page_stride == 2 * 4 * model.head_dim * 2  # K+V of 4 tokens, bf16
                for j, h in enumerate(dt.heads):
                    if h in st.heads:
                        i = st.heads.index(h)
                        expected.append(
                            (layer, i * st.head_stride + 3 * page, j * dt.head_stride + 10 * page, 4 * page)
                        )
            assert [(r.layer, r.src_off, r.dst_off, r.length) for r in ranges] == expected
            total += len(ranges)
    # every (destination rank, layer, head it holds) is served by exactly one range
    assert total == len(model.attention_layers) * model.num_kv_heads * (b if b > model.num_kv_heads else 1)


def test_plan_tp1_coalesces_state_too():
    """TP 1 -> 1: one range per (KV layer, head), one per conv and per recurrent slot."""
    model = tiny_model(hk=4, hv=8, kvh=2)
    (s,), (d,) = _schemas(model, 1), _schemas(model, 1)
    ranges = plan(s, d, [3, 4, 5, 6], [10, 11, 12, 13], 0, 1)
    kvh = model.num_kv_heads
    assert len(ranges) == kvh * len(model.attention_layers) + 2 * len(model.gdn_layers)


@pytest.mark.parametrize("a,b", [(2, 1), (1, 2)], ids=lambda n: f"tp{n}")
@pytest.mark.parametrize(
    "src_blocks,dst_blocks,runs",
    [
        pytest.param([6, 7, 8, 2], [1, 2, 3, 9], 2, id="src-gap"),  # sorted by source: 2 | 6 7 8
        pytest.param([3, 4, 5, 6], [10, 11, 20, 21], 2, id="dst-gap"),
        pytest.param([1, 3, 5, 7], [2, 4, 6, 8], 4, id="no-run"),
    ],
)
def test_plan_non_consecutive_blocks(a, b, src_blocks, dst_blocks, runs):
    """Blocks that are not consecutive on both sides: one range per run, per (layer, head)."""
    model = tiny_model(hk=4, hv=8, kvh=2)
    src, dst = _schemas(model, a), _schemas(model, b)
    for d in dst:
        for s in src:
            ranges = _kv_ranges(s, d, src_blocks, dst_blocks)
            heads = len(set(s.tensor(1, "paged_kv").heads) & set(d.tensor(1, "paged_kv").heads))
            assert len(ranges) == runs * heads * len(model.attention_layers)
            page = s.tensor(1, "paged_kv").page_stride
            assert sum(r.length for r in ranges) == len(src_blocks) * page * heads * len(model.attention_layers)


def test_plan_conv_is_segment_aware():
    """TP 1 -> 2: rank 1's conv state is [q_1 | k_1 | v_1], three ranges, not one contiguous half."""
    model = tiny_model(hk=4, hv=8, kvh=2)
    s = build_schema(engine_cfg(model, 1), 0, make_pools(engine_cfg(model, 1), 0))
    d = build_schema(engine_cfg(model, 2), 1, make_pools(engine_cfg(model, 2), 1))
    conv = [r for r in plan(s, d, [0], [0], 0, 0) if r.kind == "gdn_conv" and r.layer == 0]
    row = 3 * 2  # Kc - 1 columns of bf16
    kd, vd = 4 * 4, 8 * 8
    assert [(r.src_off // row, r.dst_off // row, r.length // row) for r in conv] == [
        (kd // 2, 0, kd // 2),
        (kd + kd // 2, kd // 2, kd // 2),
        (2 * kd + vd // 2, kd, vd // 2),
    ]


def test_plan_refuses_bad_ids():
    model = tiny_model()
    cfg = engine_cfg(model, 1)
    s = build_schema(cfg, 0, make_pools(cfg, 0))
    with pytest.raises(PlanError, match="outside"):
        plan(s, s, [0, 10_000], [0, 1], 0, 0)
    with pytest.raises(PlanError, match="duplicate"):
        plan(s, s, [1, 1], [0, 1], 0, 0)
    with pytest.raises(PlanError, match="state slot"):
        plan(s, s, [0], [0], 0, 99)
    with pytest.raises(PlanError, match="source blocks"):
        plan(s, s, [0, 1], [0], 0, 0)


def test_plan_refuses_unknown_kv_layout():
    """A KV pool described in another axis order (e.g. block-major pages) is refused, not guessed."""
    model = tiny_model()
    (s,) = _schemas(model, 1)
    old = tuple(
        msgspec.structs.replace(t, axes=("block", "kv", "head", "token", "dim")) if t.kind == "paged_kv" else t
        for t in s.tensors
    )
    s = msgspec.structs.replace(s, tensors=old)
    with pytest.raises(PlanError, match="pool axes"):
        plan(s, s, [0], [0], 0, 0)

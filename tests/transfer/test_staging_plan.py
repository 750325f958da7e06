"""The transfer's bfloat16 staging (transfer/staging.py) inside the cache budget: the bytes the
plan sets aside equal the regions a real sender makes for a bfloat16 decode node, counted from the
model's shapes (GDN layers x value heads x key dim x value dim x 2 bytes x slots); the KV pages get
the rest; a bfloat16 state needs none. `pdserve prefill --transfer-staging-slots` sets the slots of
both, the engine's memory plan says it, and a bad value is one line, exit status 2."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.cache import plan_capacity
from engine.cache.spec import build_specs
from tests.helpers.xfer_state import LAYERS, engine_cfg, make_pools, tiny_model
from transfer import Receiver, Sender, TransferConfig

pytestmark = pytest.mark.timeout(120)


def _by_hand(model, slots: int) -> int:
    """Staging bytes from the model's shapes: one bfloat16 recurrent state per GDN layer and slot."""
    gdn = sum(t == "linear_attention" for t in LAYERS)
    return gdn * model.linear_num_value_heads * model.linear_key_head_dim * model.linear_value_head_dim * 2 * slots


def _with_staging(cfg, slots: int, recurrent: str = "float32"):
    return replace(cfg, cache=replace(cfg.cache, staging_slots=slots, recurrent_dtype=recurrent))


@pytest.mark.parametrize("slots", [1, 3])
def test_the_plan_pays_for_the_staging_a_sender_makes(slots):
    model = tiny_model()
    sc = _with_staging(engine_cfg(model, 1, memory="256KiB"), slots)
    dc = _with_staging(engine_cfg(model, 1), 0, "bfloat16")
    specs, budget = build_specs(sc, 0), sc.cache.memory_bytes
    cap = plan_capacity(specs, budget, sc.num_state_slots, sc.cache.block_size, staging_slots=slots)
    bare = plan_capacity(specs, budget, sc.num_state_slots, sc.cache.block_size)
    assert cap.staging_bytes == _by_hand(model, slots) > 0
    page = sum(s.page_size_bytes for s in specs if s.kind != "gdn")
    assert cap.num_blocks == (budget - cap.state_bytes - _by_hand(model, slots)) // page < bare.num_blocks
    assert cap.kv_bytes + cap.state_bytes + cap.staging_bytes <= budget

    tc = TransferConfig(backend="nixl", staging_slots=slots)
    tx, rx = Sender(sc, 0, make_pools(sc, 0), "P", tc), Receiver(dc, 0, make_pools(dc, 0), "D", tc)
    try:
        tx.add_peer(rx.metadata())  # a bfloat16 peer: the sender makes its staging now
        made = sum(t.numel() * t.element_size() for t in tx.staging.regions.values())
        assert made == cap.staging_bytes
    finally:
        tx.close()
        rx.close()


def test_a_bfloat16_state_needs_no_staging():
    cfg = _with_staging(engine_cfg(tiny_model(), 1, memory="256KiB"), 4, "bfloat16")
    cap = plan_capacity(build_specs(cfg, 0), cfg.cache.memory_bytes, cfg.num_state_slots, 4, staging_slots=4)
    assert cap.staging_bytes == 0


def test_the_prefill_option_reaches_the_engine_plan_and_its_log(tmp_path, caplog):
    from engine.core import EngineCore
    from prefill_node.config import PrefillNodeConfig
    from tests.helpers import hybrid_ckpt as hc

    ckpt = hc.make(tmp_path / "ckpt", hc.SPEC_HV2)
    ecfg = PrefillNodeConfig(model=ckpt, dtype="float32", transfer_staging_slots=2).engine_config()
    assert ecfg.cache.staging_slots == 2
    m = ecfg.model
    gdn = sum(t == "linear_attention" for t in m.layer_types)
    want = gdn * m.linear_num_value_heads * m.linear_key_head_dim * m.linear_value_head_dim * 2 * 2
    with caplog.at_level("INFO", logger="pdserve"):
        core = EngineCore(ecfg)
    try:
        assert core.capacity.staging_bytes == want
        assert f"transfer staging {want / 2**20:.1f} MiB" in caplog.text
    finally:
        core.close()


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["prefill", "--transfer-staging-slots", "0"], "--transfer-staging-slots must be at least 1 (got 0)"),
        (["up", "--transfer-staging-slots", "-1"], "--transfer-staging-slots must be at least 1 (got -1)"),
        (["prefill", "--transfer-staging-slots", "two"], "argument --transfer-staging-slots: invalid"),
    ],
)
def test_a_bad_staging_slot_count_is_one_line(tmp_path, argv, words, capsys):
    from router.cli import main
    from tests.helpers import hybrid_ckpt as hc

    ckpt = hc.make(tmp_path / "ckpt", hc.SPEC_HV2)
    capsys.readouterr()  # the writer's progress
    try:
        rc = main([*argv, "--model", ckpt, "--insecure-open-cluster"])
    except SystemExit as e:  # argparse's own refusal
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0] and err[0].startswith(f"pdserve {argv[0]}: error: "), err

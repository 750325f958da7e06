"""`pdserve up` refuses pools whose nodes could never hand state to each other (router/pools.py
`_same_state`): a prefill pool with another recurrent-state dtype, speculative method or count,
dtype, page size or batch-invariance than the decode pool would be passed over by the router for
good, every prompt computed on the decode nodes. One line, before anything starts."""

from __future__ import annotations

import pytest

from router.cli import main


@pytest.mark.parametrize(
    "prefill,words",
    [
        ("mamba_ssm_cache_dtype: bfloat16", "mamba_ssm_cache_dtype (bfloat16 vs float32): a bfloat16 recurrent"),
        ("block_size: 32", "block_size (32 vs 16)"),
        ("{num_speculative_tokens: 2, speculative_method: ngram}", "speculative method (ngram vs none)"),
        (
            'hf_overrides: \'{"rope_parameters": {"partial_rotary_factor": 0.5}}\'',
            "partial_rotary_factor (hf_overrides) (0.5 vs 0.25)",
        ),
        ("hf_overrides: '{\"rms_norm_eps\": 0.001}'", "rms_norm_eps (hf_overrides) (0.001 vs 1e-06)"),
    ],
)
def test_pools_that_cannot_hand_off_are_refused(tmp_path, capsys, prefill, words):
    from engine.tiny_model import TinyModelSpec, make_tiny_model

    model = make_tiny_model(tmp_path / "m", TinyModelSpec(layers=2, hidden=64, full_attention_interval=2))
    cfg = tmp_path / "pools.yaml"
    body = f"  {prefill}" if not prefill.startswith("{") else "  " + prefill[1:-1].replace(", ", "\n  ")
    cfg.write_text(f"prefill:\n  count: 1\n{body}\ndecode:\n  count: 1\n")
    assert main(["up", "--model", str(model), "--config", str(cfg), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert f"the prefill and decode pools differ in {words}" in err, err


def test_a_float32_prefill_pool_may_feed_a_bfloat16_decode_pool(tmp_path):
    """The one recurrent dtype difference a transfer plan casts (float32 prefill -> bfloat16
    decode, docs/transfer.md) is accepted; each pool's nodes get their own value."""
    from engine.tiny_model import TinyModelSpec, make_tiny_model
    from router.cli import build_parser
    from router.pools import spec_from_args

    model = make_tiny_model(tmp_path / "m", TinyModelSpec(layers=2, hidden=64, full_attention_interval=2))
    cfg = tmp_path / "pools.yaml"
    cfg.write_text(
        f"model: {model}\nprefill:\n  count: 1\n  mamba_ssm_cache_dtype: float32\n"
        "decode:\n  count: 1\n  mamba_ssm_cache_dtype: bfloat16\n"
    )
    spec = spec_from_args(build_parser().parse_args(["up", "--config", str(cfg)]), default_model=lambda: None)
    assert spec.prefill_options["mamba_ssm_cache_dtype"] == "float32"
    assert spec.decode_options["mamba_ssm_cache_dtype"] == "bfloat16"

"""--max-model-len against the checkpoint (engine/config_fields.py `max_model_len`), checked where
the engine's config is made, so `LLM`, the nodes and `pdserve up`'s checks refuse alike: negative
is refused, 0 is the checkpoint's positions, more than them needs VLLM_ALLOW_LONG_MAX_MODEL_LEN=1;
and the engine's ready line states the dtype and the max model length."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from engine.config import EngineArgs

ALLOW_LONG_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"  # vLLM's name, as recipes set it


def _positions(ckpt) -> int:
    return json.loads((Path(ckpt) / "config.json").read_text())["max_position_embeddings"]


def _check(ckpt, n: int | None) -> int:
    return EngineArgs(model=str(ckpt), max_model_len=n).engine_config(check_only=True).max_model_len


def test_zero_or_none_is_the_checkpoints(ckpt_hv2):
    assert _check(ckpt_hv2, None) == _check(ckpt_hv2, 0) == _positions(ckpt_hv2)
    assert _check(ckpt_hv2, 100) == 100


def test_negative_is_refused(ckpt_hv2):
    with pytest.raises(ValueError, match="max_model_len -1 must be >= 1"):
        _check(ckpt_hv2, -1)


def test_past_the_checkpoints_positions_is_refused_unless_allowed(ckpt_hv2, monkeypatch):
    n = _positions(ckpt_hv2)
    monkeypatch.delenv(ALLOW_LONG_ENV, raising=False)
    with pytest.raises(ValueError) as e:
        _check(ckpt_hv2, n + 1)
    assert f"max_model_len {n + 1} exceeds the checkpoint's {n} positions" in str(e.value)
    assert ALLOW_LONG_ENV in str(e.value) and "\n" not in str(e.value)
    monkeypatch.setenv(ALLOW_LONG_ENV, "1")
    assert _check(ckpt_hv2, n + 1) == n + 1


def test_ready_line_states_dtype_and_max_model_len(ckpt_hv2, caplog):
    from engine import LLM

    with caplog.at_level(logging.INFO, logger="pdserve"), LLM(ckpt_hv2, dtype="float32", max_model_len=96):
        pass
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready in")]
    assert "float32" in line and "max_model_len 96" in line and "\n" not in line

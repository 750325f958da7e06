"""`pdserve up` checks every pool's options before it starts anything, and does so without torch:
importing it took the launcher 3 s of every start-up before any node began its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import hybrid_ckpt as hc

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import json, sys
from router.cli import build_parser, _up_spec
args = build_parser().parse_args(["up", "--model", sys.argv[1], *sys.argv[2:]])
try:
    spec = _up_spec(args)
    out = {"ok": [spec.prefill, spec.decode, spec.decode_tp]}
except (ValueError, FileNotFoundError) as e:
    out = {"refused": str(e)}
out["torch"] = any(m == "torch" or m.startswith("torch.") for m in sys.modules)
out["tokenizers"] = "tokenizers" in sys.modules
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return hc.make(tmp_path_factory.mktemp("up-checks") / "ckpt", hc.SPEC_HV2)


def _check(ckpt: str, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-c", CHECK, ckpt, *args], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_up_checks_its_pools_without_torch(ckpt):
    got = _check(ckpt, "--prefill", "1", "--decode", "2", "--decode-tp", "2", "--dtype", "bfloat16")
    assert got == {"ok": [1, 2, 2], "torch": False, "tokenizers": False}


def test_a_bad_pool_option_is_still_refused_before_anything_starts(ckpt):
    # SPEC_HV2's 4 GDN key heads: TP 8 cannot split them; the node would refuse it the same way
    got = _check(ckpt, "--decode", "1", "--decode-tp", "8")
    assert "tensor_parallel_size=8 does not divide linear_num_key_heads=4" in got.get("refused", ""), got
    assert got["torch"] is False


def test_a_directory_without_a_checkpoint_is_refused(tmp_path):
    got = _check(str(tmp_path), "--decode", "1")
    assert "no config.json" in got.get("refused", ""), got


def test_a_model_without_a_full_attention_layer_is_refused_before_anything_starts(tmp_path):
    """3 layers, a full-attention layer every 4th (transformers' own config writes it so): a model
    with no paged KV at all. Was: the up-front checks passed it, the router started, and each node
    then refused it."""
    import json as js

    from engine.tiny_model import TinyModelSpec, make_tiny_model

    model = make_tiny_model(tmp_path / "m", TinyModelSpec(layers=3, hidden=64))
    kinds = js.loads((tmp_path / "m" / "config.json").read_text())["layer_types"]
    assert "full_attention" not in kinds, kinds  # transformers' reading of the config agrees
    got = _check(str(model), "--decode", "1")
    assert "no full-attention layer (3 layers, full_attention_interval 4)" in got.get("refused", ""), got


def test_an_unknown_way_to_start_nodes_is_refused(ckpt):
    got = _check(ckpt, "--node-start", "thread")
    assert got.get("refused") == "--node-start must be fork or spawn (got 'thread')", got


def test_a_host_that_does_not_resolve_is_refused_before_anything_starts(ckpt):
    """Was: the router started, gRPC logged its own `add_port.cc` line, then pdserve's error."""
    got = _check(ckpt, "--host", "nonexistent.invalid")
    assert got.get("refused", "").startswith("--host 'nonexistent.invalid' does not resolve"), got
    assert _check(ckpt, "--host", "localhost")["ok"] == [1, 1, 1]


def test_demo_checks_its_nodes_before_it_starts_them(ckpt):
    """`pdserve demo --tp 3`: one line and status 2, as `up` refuses it, not a router started and
    then a node's refusal."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PDSERVE_LOG="ERROR")
    argv = [sys.executable, "-m", "router.cli", "demo", "--model", ckpt, "--tp", "3"]
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines() == ["pdserve demo: error: tensor_parallel_size must be 1, 2, 4 or 8 (got 3)"]

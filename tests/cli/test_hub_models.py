"""A model named by its Hugging Face repo id (engine/hub.py), as vLLM users name it: a snapshot in
the local Hugging Face cache (laid out as the hub lays it out: refs/main naming the snapshot) is
the directory every command loads, and its served name is ORG/NAME; a repo this machine cannot
fetch (HF_HUB_OFFLINE here) is one line and exit status 2, naming what to do."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import hybrid_ckpt as hc

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(hc.make(tmp_path_factory.mktemp("hub") / "ckpt", hc.SPEC_HV2))


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )


def _cache(tmp_path: Path, ckpt: str) -> Path:
    hub = tmp_path / "hub"
    snap = hub / "models--Org--Tiny-Hybrid" / "snapshots" / "0123abcd"
    shutil.copytree(ckpt, snap)
    (hub / "models--Org--Tiny-Hybrid" / "refs").mkdir()
    (hub / "models--Org--Tiny-Hybrid" / "refs" / "main").write_text("0123abcd")
    return hub


def test_a_repo_id_is_its_cached_snapshot(tmp_path, ckpt):
    hub = _cache(tmp_path, ckpt)
    env = {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    code = (
        "from engine.hub import resolve; from router.model_names import model_id; "
        "from engine.config import ModelConfig; p = resolve('Org/Tiny-Hybrid'); "
        "ModelConfig.from_dir(p, check_only=True); print(p); print(model_id(p)); print(resolve(p) == p)"
    )
    r = _run(code, env)
    assert r.returncode == 0, r.stderr
    path, name, same = r.stdout.split()
    assert Path(path) == hub / "models--Org--Tiny-Hybrid" / "snapshots" / "0123abcd"
    assert (name, same) == ("Org/Tiny-Hybrid", "True")


def test_a_repo_this_machine_cannot_fetch_is_one_line(tmp_path):
    env = {"HF_HUB_CACHE": str(tmp_path / "empty"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "router.cli", "up", "--model", "Org/Not-Here", "--port", "0"],
        cwd=ROOT,
        env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdserve up: error: Org/Not-Here is neither a checkpoint")
    assert "HF_HUB_OFFLINE is set" in lines[0] and "Traceback" not in r.stderr

"""The engine on CUDA with GDN prefill through flash-linear-attention (kernels/fla_gdn.py) against
the same engine on our Triton kernel, which tests/engine/test_cuda.py holds equal to
transformers: float32 greedy tokens, prompts of 1 to 200 tokens prefilled whole and in chunks of
64 (later chunks start from the state the earlier ones left). In a child process: tests/conftest.py
blocks fla's import here so that transformers stays on its own code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import hybrid_ckpt as hc

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, os, sys
import kernels.fla_gdn as F
if F._fla_chunk() is None:
    print(json.dumps({"skip": "flash-linear-attention does not import"})); sys.exit(0)
from tests.helpers import hybrid_ckpt as hc
path = sys.argv[1]
out = {}
for kernel in ("fla", "pdserve"):
    os.environ["PDSERVE_GDN_PREFILL"] = kernel
    for budget in (64, 4096):
        out[f"{kernel}-{budget}"] = hc.engine_greedy(path, hc.prompts(), 16, device="cuda", max_num_batched_tokens=budget)
print(json.dumps(out))
"""


def test_fla_prefill_gives_our_kernels_tokens(tmp_path):
    path = hc.make(tmp_path / "ckpt", hc.SPEC_HV2)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-c", CHILD, path], capture_output=True, text=True, env=env, cwd=ROOT, timeout=560
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    if "skip" in got:
        pytest.skip(got["skip"])
    for budget in (64, 4096):
        fla, ours = got[f"fla-{budget}"], got[f"pdserve-{budget}"]
        same = sum(a == b for a, b in zip(fla, ours))
        # float32 both ways: a token may flip only on a near-tie, late in a generation
        assert same >= len(ours) - 1, f"budget {budget}: {len(ours) - same} of {len(ours)} prompts differ"
        for a, b in zip(fla, ours):
            assert a[:4] == b[:4], f"budget {budget}: the first tokens differ: {a[:4]} vs {b[:4]}"

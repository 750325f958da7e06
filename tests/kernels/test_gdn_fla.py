"""GDN prefill through flash-linear-attention (kernels/fla_gdn.py) against the PyTorch reference
on the CPU, beside our Triton kernel on the same inputs: outputs and final states, rows of mixed
lengths, some continuing a saved state, slots out of order, unused slots NaN. fla runs in a child
process: tests/conftest.py blocks its import here so that transformers stays on its own code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import fla_gdn

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys, torch
from kernels.gdn import gdn_chunk_prefill, l2norm
import kernels.fla_gdn as F
if F._fla_chunk() is None:
    print(json.dumps({"skip": "flash-linear-attention does not import"})); sys.exit(0)
gen = torch.Generator().manual_seed(0)
HK, HV, D = 4, 8, 128
lens = [300, 1, 64, 129, 17]
T, B = sum(lens), len(lens)
cu = torch.tensor([0] + lens).cumsum(0)
q = l2norm(torch.randn(T, HK, D, generator=gen)).bfloat16()
k = l2norm(torch.randn(T, HK, D, generator=gen)).bfloat16()
v = torch.randn(T, HV, D, generator=gen).bfloat16()
g = -torch.nn.functional.softplus(torch.randn(T, HV, generator=gen) - 1.0)
beta = torch.sigmoid(torch.randn(T, HV, generator=gen))
pool = torch.full((8, HV, D, D), float("nan"))
slots = torch.tensor([6, 1, 3, 0, 4])
init = torch.tensor([True, False, True, False, True])
pool[slots[init]] = torch.randn(int(init.sum()), HV, D, D, generator=gen) * 0.1
ref_pool = pool.clone()
ref = gdn_chunk_prefill(q.float(), k.float(), v.float(), g, beta, cu, ref_pool, slots, init, scale=D**-0.5)
out = {}
for name in ("fla", "pdserve"):
    import os; os.environ["PDSERVE_GDN_PREFILL"] = name
    p = pool.cuda()
    o = gdn_chunk_prefill(q.cuda(), k.cuda(), v.cuda(), g.cuda(), beta.cuda(), cu.cuda(), p, slots.cuda(), init.cuda(), scale=D**-0.5)
    torch.cuda.synchronize()
    p = p.cpu()
    used = torch.zeros(8, dtype=torch.bool); used[slots] = True
    out[name] = {
        "o": float((o.float().cpu() - ref).abs().max() / ref.abs().max()),
        "state": float((p[slots] - ref_pool[slots]).abs().max() / ref_pool[slots].abs().max()),
        "untouched_nan": bool(p[~used].isnan().all()),
    }
print(json.dumps(out))
"""


def test_choice_is_checked(monkeypatch):
    monkeypatch.setenv("PDSERVE_GDN_PREFILL", "fast")
    with pytest.raises(ValueError, match="PDSERVE_GDN_PREFILL must be one of"):
        fla_gdn.choice()


def test_cpu_never_takes_fla():
    import torch

    assert not fla_gdn.usable(torch.zeros(1), None)


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_fla_matches_the_reference_as_closely_as_ours():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, cwd=ROOT, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    if "skip" in got:
        pytest.skip(got["skip"])
    fla, ours = got["fla"], got["pdserve"]
    assert fla["untouched_nan"] and ours["untouched_nan"]
    for key in ("o", "state"):  # bf16 inputs: both within a few bf16 roundings of the float32 reference
        assert fla[key] < max(3 * ours[key], 2e-2), got

"""The engine's OpenMP wait policy: importing it first sets PASSIVE before torch loads; a process
that loaded torch first keeps OpenMP's default, and `LLM` on the CPU warns with the fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = (
    "import os; {first}; from engine.llm import warn_openmp_policy; "
    "print(os.environ.get('OMP_WAIT_POLICY'), '|', warn_openmp_policy('{device}'))"
)


def _probe(first: str, device: str = "cpu", policy: str | None = None) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    env["PYTHONPATH"] = str(ROOT)
    code = PROBE.format(first=first, device=device)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    pol, msg = (s.strip() for s in out.stdout.strip().splitlines()[-1].split("|"))
    return pol, msg


@pytest.mark.parametrize(
    "first, device, policy, want_policy, warns",
    [
        ("import engine, torch", "cpu", None, "PASSIVE", False),  # the engine first: PASSIVE, no warning
        ("import torch, engine", "cpu", None, "PASSIVE", True),  # torch first: too late for this process
        ("import torch, engine", "cuda", None, "PASSIVE", False),  # only the CPU path cares
        ("import torch, engine", "cpu", "ACTIVE", "ACTIVE", False),  # the user chose a policy: kept
    ],
)
def test_policy_and_warning(first, device, policy, want_policy, warns):
    pol, msg = _probe(first, device, policy)
    assert pol == want_policy
    if warns:
        assert "OMP_WAIT_POLICY=PASSIVE" in msg and "import engine before torch" in msg
    else:
        assert msg == "None"

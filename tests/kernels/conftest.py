"""Kernel tests: each Triton kernel against its PyTorch reference, each reference against the
naive loop. Without a GPU the Triton kernels run on CPU tensors under the interpreter, which
Triton reads when a kernel is decorated, so it is switched on here, before any kernel module is
imported. With a GPU the same tests run the compiled kernels on CUDA tensors.
Tests marked `slow` (large interpreter cases) run only with PDSERVE_SLOW=1."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PDSERVE_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow tier: set PDSERVE_SLOW=1")
    for item in items:
        if "slow" in item.keywords and str(item.fspath).startswith(os.path.dirname(__file__)):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_forced_dispatch(monkeypatch):
    """References must run the PyTorch path whatever the caller's environment says."""
    monkeypatch.delenv("PDSERVE_FORCE_TRITON", raising=False)

"""NIXL's log lines go through the process's logging (transfer/nixl_api.py): at INFO its own
INFO lines (a handler of NIXL's, its own format, whatever the process's level) are gone; at DEBUG
they come in the process's format."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import logging, torch
logging.basicConfig(level=logging.{level}, format="%(levelname)s %(name)s: %(message)s")
from transfer.nixl_backend import NixlTransport
NixlTransport("agent-x", {{(0, "k"): torch.zeros(64, dtype=torch.uint8)}})
print("made", flush=True)
"""


@pytest.mark.parametrize("level", ["INFO", "DEBUG"])
def test_nixl_logs_at_the_process_level_and_format(level):
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(level=level)], capture_output=True, text=True, timeout=120
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "made" in text, text
    assert "NIXL INFO" not in text  # NIXL's own handler and format
    assert ("INFO nixl." in text and "Initialized NIXL agent: agent-x" in text) == (level == "DEBUG"), text

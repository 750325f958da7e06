"""`pdserve demo`: up (one prefill + one decode node), a few prompts streamed through the SDK,
TTFT / TPOT / transfer figures per request, clean exit."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.serve_harness import ROOT


def test_demo_streams_and_exits_cleanly(ckpt):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-m", "router.cli", "demo", "--model", ckpt, "--max-tokens", "6"],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("TTFT") == 4 and r.stdout.count("TPOT") == 4
    assert "nodes registered: 2/2 decode-0 prefill-0" in r.stdout and "4 requests, 24 new tokens" in r.stdout
    assert r.stdout.count("prefill prefill-0") == 4 and r.stdout.count(" B in ") == 4
    assert "transfer 0 B" not in r.stdout

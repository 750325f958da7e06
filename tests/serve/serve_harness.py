"""Helpers for the serving tests: `pdserve up` as a subprocess, registry and node queries, waits."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import hybrid_ckpt as hc

from router.launch import die_with_parent

ROOT = Path(__file__).resolve().parents[2]
SPEC = dataclasses.replace(hc.SPEC_HV2, tokenizer=True)


LENS = (1, 3, 64, 65, 200)
NEW = 16


class Up:
    """`pdserve up ...` as a subprocess; its output is collected by a reader thread."""

    def __init__(self, *args: str, timeout: float = 180.0):
        env = dict(os.environ, PYTHONPATH=str(ROOT), PDSERVE_LOG="INFO")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "up", "--port", "0", *args],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            preexec_fn=die_with_parent,  # a killed test run takes its cluster down with it
        )  # fmt: skip
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.address: str | None = None
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(timeout) or self.address is None:
            self.stop()
            raise RuntimeError("pdserve up did not become ready:\n" + self.output())

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"pdserve up: ready at (\S+)", line)
            if m:
                self.address = m.group(1)
                self._ready.set()
        self._ready.set()  # exited

    def output(self) -> str:
        return "".join(self.lines[-200:])

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise


def nodes(address: str):
    from proto import pb, rpc
    from proto.serving import channel

    with channel(address) as ch:
        return list(rpc.RegistryStub(ch).ListNodes(pb.ListNodesRequest(), timeout=10).nodes)


def decode_stats(node_address: str):
    from proto import pb, rpc
    from proto.serving import channel

    with channel(node_address) as ch:
        return rpc.DecodeNodeStub(ch).Stats(pb.StatsRequest(), timeout=10)


def prefill_stats(node_address: str):
    from proto import pb, rpc
    from proto.serving import channel

    with channel(node_address) as ch:
        return rpc.PrefillNodeStub(ch).Stats(pb.StatsRequest(), timeout=10)


def wait_for(pred, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")

"""tools/gpu_check.sh on this machine: `run` installs from a wheel folder with pip --no-index,
runs the same selection as on a GPU host (every `gpu`-marked test of tests/kernels, tests/engine
and tests/transfer, then the benchmark), and without a CUDA device reports that the gpu tests
were skipped and exits 3; a missing wheel fails the install step and the run; bad arguments get
one line and exit 2. (`prepare` needs a package index; docs/gpu.md records its output.)"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "gpu_check.sh"

pytestmark = pytest.mark.timeout(180)


def _run(*args, timeout=150) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(TOOL), *map(str, args)], capture_output=True, text=True, timeout=timeout)


def _wheels(tmp_path: Path, *requirements: str) -> Path:
    d = tmp_path / "wheels"
    d.mkdir()
    (d / "requirements.txt").write_text("".join(r + "\n" for r in requirements))
    return d


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report of a machine without a GPU")
def test_run_without_gpu_skips_the_gpu_tests_and_says_so(tmp_path):
    # msgspec is installed here: pip --no-index finds it satisfied, as the image's packages would be
    wheels, out = _wheels(tmp_path, "msgspec"), tmp_path / "out"
    r = _run("run", wheels, out, "--python", sys.executable)
    assert r.returncode == 3, r.stdout + r.stderr
    report = (out / "report.txt").read_text()
    assert r.stdout == report
    lines = report.splitlines()
    assert lines[0] == "pdserve GPU check" and lines[1].startswith("date: 20")
    assert "gpu: none: torch.cuda.is_available() is False" in lines
    step = {line.split()[0]: line.split()[1] for line in lines if line.startswith("  ") and len(line.split()) > 1}
    assert (step["install"], step["imports"], step["tests"], step["bench"]) == ("PASS",) * 4
    # the junit file, read here: every collected test is gpu-marked, skipped for want of a device,
    # and the selection holds the model-size kernels, the engine on CUDA and the VRAM transfer
    cases = list(ET.parse(out / "tests.xml").getroot().iter("testcase"))
    files = {c.get("classname").rsplit(".", 1)[-1] for c in cases}
    assert {"test_model_shapes", "test_cuda", "test_transfer_gpu", "test_moe"} <= files, files
    reasons = {c.find("skipped").get("message") for c in cases if c.find("skipped") is not None}
    assert len(cases) >= 30 and all(c.find("skipped") is not None for c in cases) and reasons == {"needs a CUDA device"}
    assert f"{len(cases)} skipped (skipped: {len(cases)} needs a CUDA device)" in report
    assert "benchmark skipped: no CUDA device" in report
    assert lines[-1].startswith(
        f"result: NO GPU (no CUDA device: the {len(cases)} gpu tests were collected and skipped"
    )


def test_run_fails_when_a_wheel_is_missing(tmp_path):
    wheels, out = _wheels(tmp_path, "pdserve-no-such-package==1.0"), tmp_path / "out"
    r = _run("run", wheels, out, "--python", sys.executable)
    assert r.returncode == 1, r.stdout + r.stderr
    report = (out / "report.txt").read_text()
    install = next(line for line in report.splitlines() if line.strip().startswith("install"))
    assert "FAIL" in install and "pdserve-no-such-package" in install, install
    assert "tests    not run an earlier step failed" in report
    assert report.splitlines()[-1] == "result: FAIL (install)"
    assert "No matching distribution" in (out / "install.log").read_text()


@pytest.mark.parametrize(
    "args,message",
    [
        (["prepare", "{tmp}/w", "--cuda", "11"], "prepare: --cuda must be 12 or 13 (got '11')"),
        (["prepare", "{tmp}/w", "--python-version", "312"], "prepare: --python-version must look like 3.12"),
        (["run", "{tmp}/nowhere", "{tmp}/out"], "run: wheel folder {tmp}/nowhere does not exist"),
        (["run", "{tmp}", "{tmp}/out", "--fast"], "run: unknown option --fast"),
        (["check"], "unknown command 'check' (prepare or run)"),
    ],
    ids=["bad-cuda", "bad-python-version", "no-wheel-folder", "unknown-option", "unknown-command"],
)
def test_bad_arguments_get_one_line_and_exit_2(tmp_path, args, message):
    r = _run(*[a.format(tmp=tmp_path) for a in args], timeout=30)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and message.format(tmp=tmp_path) in r.stderr, r.stderr

"""An environment holding another distribution named `kernels` (Hugging Face's, which
transformers>=5.25 requires) hides this project's kernels/ package: importing the engine says so
and how to mend it, and the CLI exits 2 with that one line, not a traceback from deep inside."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], extra_path: Path | None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_path), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def _foreign(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    (site / "kernels-0.19.1.dist-info").mkdir(parents=True)
    (site / "kernels-0.19.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: kernels\nVersion: 0.19.1\n"
    )
    return site


def test_the_engine_imports_without_a_foreign_kernels(tmp_path):
    r = _run(["-c", "import engine.config"], tmp_path)
    assert r.returncode == 0, r.stderr


def test_the_engine_names_a_foreign_kernels_and_the_mend(tmp_path):
    site = _foreign(tmp_path)
    r = _run(["-c", "import engine.config"], site)
    assert r.returncode != 0
    assert f"({site / 'kernels-0.19.1.dist-info'})" in r.stderr
    assert "pip uninstall -y kernels" in r.stderr


def test_the_cli_exits_2_with_one_line(tmp_path):
    r = _run(["-m", "router.cli", "up", "--model", str(tmp_path)], _foreign(tmp_path))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdserve: error: a package named `kernels` is installed"), r.stderr

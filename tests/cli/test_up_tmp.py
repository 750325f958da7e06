"""`pdserve up`'s temporary directory (router/launch.py): named by the pid of the `up` that made
it, so that one killed without cleaning up (SIGKILL) leaves no cluster token behind for long:
the next `up` removes the directories of pids that are gone, and no live one's."""

from __future__ import annotations

import os
import subprocess
import sys

from router.launch import TMP_PREFIX, sweep_stale_dirs


def test_a_dead_ups_directory_is_swept_and_a_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = tmp_path / f"{TMP_PREFIX}{int(dead.stdout)}-abc"
    live = tmp_path / f"{TMP_PREFIX}{os.getpid()}-def"
    other = tmp_path / "pdserve-up-notapid"
    for d in (gone, live, other):
        d.mkdir()
        (d / "cluster-token").write_text("secret")
    assert sweep_stale_dirs(str(tmp_path)) == [str(gone)]
    assert not gone.exists() and live.exists() and other.exists()

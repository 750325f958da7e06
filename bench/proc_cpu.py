"""CPU seconds (user + system, from /proc) of a process alone, of a process with its live
descendants (a node and its rank processes), and of this process: what bench/serve.py reads before
and after a run to say where the served CPU went. Linux only."""

from __future__ import annotations

import os

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """The process's own CPU seconds (all its threads); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/children") as f:
                out += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return out


def tree_cpu_s(pid: int) -> float:
    """The process's CPU seconds and those of its live descendants."""
    return cpu_s(pid) + sum(tree_cpu_s(c) for c in children(pid))


def self_cpu_s() -> float:
    t = os.times()
    return t.user + t.system

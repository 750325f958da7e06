"""Which CPUs each node `pdserve up` starts on one host may run on, and at what priority. `auto`:
the host's usable CPUs split between the nodes, in proportion to their ranks, contiguous, the
remainder to prefill nodes first (their compute is the first token's); each node's torch then runs
one OpenMP thread per CPU of its own. `none` (the default): every node sees every CPU (and
oversubscribes them when they are few); decode nodes on the CPU then hold their steps back while a
prompt for them computes (`decode_yield_ms`), optionally at a lower priority too (`decode_nice`), so
a prompt's compute goes ahead of decode steps and a first token waits for none of them
(docs/router.md, `up`, "Priority")."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

CpuBinding = Literal["auto", "none"]
# How a decode node that shares CPUs with prefill nodes on the CPU lets a prompt's compute go first
# (docs/router.md, `up`, "Priority"): it holds its steps back, up to this many milliseconds after
# the last one, while a prompt reserved on it is still computed or pushed (the decode option
# --yield-to-prefill-ms) ...
SHARED_DECODE_YIELD_MS = 50.0
# ... and runs at this nice value (0-19). A lower priority alone (7 until the hold came) kept the
# first tokens behind decode steps on a crowded host and starved the decode steps beside a benchmark
# client's own processes; with the hold, nice 0 served both faster (docs/benchmarks.md, CPU path)
SHARED_DECODE_NICE = 0
CPU_BINDINGS: tuple[CpuBinding, ...] = ("auto", "none")
# who gets a CPU left over after the even split, first to last
_REMAINDER_ORDER = ("prefill", "decode", "encode")


@dataclass(frozen=True)
class NodeSlot:
    """One node `up` launches: its name, its kind (prefill, decode, encode) and its ranks."""

    name: str
    kind: str
    ranks: int = 1


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask, not the host's count)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API on this platform
        return list(range(os.cpu_count() or 1))


def split_cpus(cpus: list[int], nodes: list[NodeSlot], mode: CpuBinding) -> dict[str, tuple[int, ...]]:
    """node name -> the CPUs it is bound to; {} when nothing is bound (`none`, one node alone, or
    fewer CPUs than ranks: no node could have a CPU of its own, so none is fenced in)."""
    if mode not in CPU_BINDINGS:
        raise ValueError(f"--cpu-binding must be one of {', '.join(CPU_BINDINGS)} (got {mode!r})")
    ranks = sum(n.ranks for n in nodes)
    if mode == "none" or len(nodes) < 2 or len(cpus) < ranks:
        return {}
    share = {n.name: len(cpus) * n.ranks // ranks for n in nodes}
    left = len(cpus) - sum(share.values())
    for n in sorted(nodes, key=lambda n: _REMAINDER_ORDER.index(n.kind) if n.kind in _REMAINDER_ORDER else 99):
        if left == 0:
            break
        share[n.name] += 1
        left -= 1
    out, at = {}, 0
    for n in nodes:
        out[n.name] = tuple(cpus[at : at + share[n.name]])
        at += share[n.name]
    return out


def bound_env(cpus: tuple[int, ...]) -> dict[str, str]:
    """The environment of a node bound to `cpus`: OpenMP sized to them (torch reads it at start)."""
    return {"OMP_NUM_THREADS": str(len(cpus))} if cpus else {}


def decode_nice(given: int | None, mode: CpuBinding, prefill_nodes: int, device: str) -> int:
    """The nice value (0-19) `up` starts decode nodes at. `given` wins; None: SHARED_DECODE_NICE
    where prefill and decode nodes compute on the same CPUs (device cpu, binding none, a prefill
    pool), else 0 (on their own CPUs or GPUs nothing is shared to give way on)."""
    if given is not None:
        if not 0 <= given <= 19:
            raise ValueError(f"--decode-nice must be in 0..19 (got {given})")
        return given
    return SHARED_DECODE_NICE if _shared(mode, prefill_nodes, device) else 0


def decode_yield_ms(given: float | None, mode: CpuBinding, prefill_nodes: int, device: str) -> float:
    """The --yield-to-prefill-ms `up` starts decode nodes with: `given` wins; None:
    SHARED_DECODE_YIELD_MS where prefill and decode nodes compute on the same CPUs (decode_nice's
    rule), else 0."""
    if given is not None:
        if given < 0:
            raise ValueError(f"--yield-to-prefill-ms must be >= 0 (got {given})")
        return float(given)
    return SHARED_DECODE_YIELD_MS if _shared(mode, prefill_nodes, device) else 0.0


def _shared(mode: CpuBinding, prefill_nodes: int, device: str) -> bool:
    """Prefill and decode nodes compute on the same CPUs."""
    return mode == "none" and prefill_nodes > 0 and str(device).startswith("cpu")


def lower_priority(nice: int) -> None:
    """In a child between fork and exec, after setsid: run at `nice`. With the kernel's autogroups
    a new session is a scheduling group of its own, in which a process's nice value weighs only
    against its own threads; the group's nice (/proc/self/autogroup) is what weighs against the
    other nodes, so both are set."""
    if nice <= 0:
        return
    os.nice(nice)
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:  # no autogroups (kernel option off, not Linux): the process's nice is the one
        pass

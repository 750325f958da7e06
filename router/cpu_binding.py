"""Which CPUs each node `pdserve up` starts on one host may run on, and at what priority. `auto`:
the host's usable CPUs split between the nodes, in proportion to their ranks, contiguous, the
remainder to prefill nodes first (their compute is the first token's); each node's torch then runs
one OpenMP thread per CPU of its own. `none` (the default): every node sees every CPU (and
oversubscribes them when they are few); decode nodes on the CPU then run at a lower priority than
prefill nodes (`decode_nice`), so a prompt's compute goes ahead of decode steps and a first token
waits for none of them (docs/router.md, `up`, "Priority")."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

CpuBinding = Literal["auto", "none"]
# the nice value decode nodes get where they share CPUs with prefill nodes on the CPU (0-19): the
# kernel then weighs a prefill node about 4.8 times a decode node (1024 against 215); at 10 (9.3
# times) every other process at nice 0 on the host, a benchmark client's included, starved the
# decode steps too (docs/router.md, `up`, "Priority")
SHARED_DECODE_NICE = 7
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
    shared = mode == "none" and prefill_nodes > 0 and str(device).startswith("cpu")
    return SHARED_DECODE_NICE if shared else 0


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

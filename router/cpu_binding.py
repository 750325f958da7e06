"""Which CPUs each node `pdserve up` starts on one host may run on. `auto`: the host's usable CPUs
split between the nodes, in proportion to their ranks, contiguous, the remainder to prefill nodes
first (their compute is the first token's); each node's torch then runs one OpenMP thread per CPU
of its own. `none` (the default): every node sees every CPU (and oversubscribes them when they are
few)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

CpuBinding = Literal["auto", "none"]
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

"""What a process that `pdserve up` (or a test) starts applies to itself first thing after exec:
to die with the thread that started it (PR_SET_PDEATHSIG), the CPUs it may run on and its nice
value, all asked for through the environment (`launch_env`, read by `apply_launch_env`).

The child applies them itself, not a `preexec_fn` between fork and exec: a `preexec_fn` makes
subprocess fork rather than vfork, and a fork of a process whose gRPC threads are live runs gRPC's
fork handlers, which can restart a poller whose epoll descriptor the child then closes before exec;
the child died there with `epoll_wait error: Bad file descriptor` before it ran a line of ours."""

from __future__ import annotations

import ctypes
import os
import signal

from router.cpu_binding import lower_priority

PARENT_ENV = "PDSERVE_PARENT_PID"
CPUS_ENV = "PDSERVE_CPUS"
NICE_ENV = "PDSERVE_NICE"
_PR_SET_PDEATHSIG = 1


def launch_env(cpus: tuple[int, ...] = (), nice: int = 0) -> dict[str, str]:
    """The environment that asks a child started from this process (and thread) to die with it, to
    run on `cpus` (empty: wherever it may) and at `nice` (0: as it is)."""
    env = {PARENT_ENV: str(os.getpid())}
    if cpus:
        env[CPUS_ENV] = ",".join(map(str, cpus))
    if nice > 0:
        env[NICE_ENV] = str(nice)
    return env


def apply_launch_env() -> None:
    """In the child, before it starts a thread: apply what `launch_env` asked, then drop it from
    the environment so the child's own children are not asked the same. Exits at once (SIGTERM to
    itself) when the parent is already gone."""
    parent = os.environ.pop(PARENT_ENV, None)
    cpus = os.environ.pop(CPUS_ENV, None)
    nice = os.environ.pop(NICE_ENV, None)
    if parent:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):  # not Linux: the child outlives a killed parent
            pass
        if os.getppid() != int(parent):  # the parent died before the line above
            os.kill(os.getpid(), signal.SIGTERM)
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    if nice:
        lower_priority(int(nice))

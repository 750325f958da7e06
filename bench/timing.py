"""Wall time of repeated calls, for the benchmark scripts that time one function (kernels, GEMMs,
the host side of a step): `call_times` runs it after some warm-up calls and returns each call's
seconds, for the caller to take the median, the fastest or the spread."""

from __future__ import annotations

import time
from collections.abc import Callable


def call_times(fn: Callable[[], object], reps: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `reps` calls of fn, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times

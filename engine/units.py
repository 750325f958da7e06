"""Memory sizes as options write them (`--kv-cache-memory 2GiB`)."""

from __future__ import annotations

import re


def parse_bytes(value: int | str) -> int:
    """'2GiB', '512MiB', '1.5GB', '4096' or an int -> bytes."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)?\s*", str(value), re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read a memory size from {value!r}; use e.g. '2GiB', '512MiB' or bytes")
    unit = (m.group(2) or "").upper().rstrip("B")
    powers = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
    if unit not in powers:
        raise ValueError(f"unknown memory unit in {value!r}")
    return int(float(m.group(1)) * powers[unit])

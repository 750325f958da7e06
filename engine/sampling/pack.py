"""The sampler's per-call host data on its way to the device: every integer list of a call (row
indices, token ids, seeds, new penalty tables) goes into one int64 tensor and every real list
(temperatures, top-p, penalties, biases) into one float32 tensor, so a call makes at most two
host-to-device copies whatever its batch (pinned and non-blocking on CUDA). Named sections come
back as views of the uploaded tensors."""

from __future__ import annotations

from collections.abc import Iterable

import torch


class Sections:
    """The uploaded tensors and where each named section lies in them."""

    def __init__(self, ints: torch.Tensor | None, floats: torch.Tensor | None, where: dict[str, tuple[bool, int, int]]):
        self._ints, self._floats, self._where = ints, floats, where

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __getitem__(self, name: str) -> torch.Tensor:
        is_float, a, b = self._where[name]
        t = self._floats if is_float else self._ints
        assert t is not None
        return t[a:b]


class HostPack:
    """Sections collected on the host, then `upload`ed once."""

    def __init__(self) -> None:
        self._ints: list[int] = []
        self._floats: list[float] = []
        self._where: dict[str, tuple[bool, int, int]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def ints(self, name: str, values: Iterable[int]) -> None:
        a = len(self._ints)
        self._ints.extend(values)
        self._where[name] = (False, a, len(self._ints))

    def floats(self, name: str, values: Iterable[float]) -> None:
        a = len(self._floats)
        self._floats.extend(values)
        self._where[name] = (True, a, len(self._floats))

    def upload(self, device: torch.device) -> Sections:
        """One copy per non-empty kind: int64 and float32."""
        return Sections(
            upload(self._ints, torch.long, device) if self._ints else None,
            upload(self._floats, torch.float32, device) if self._floats else None,
            dict(self._where),
        )


def upload(values: list[int] | list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`: one copy, from pinned memory without waiting on CUDA
    (the caching host allocator keeps the pinned block until the copy has run)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)

"""The SDK's checks of its callers' arguments: a badly typed one raises at once a TypeError (or a
ValueError for a value the wire cannot carry: an int past its proto field's range, an unknown
priority) naming the parameter and what it takes. Semantic ranges (temperature in [0, 2], ...)
stay the router's, which answers INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import numbers
import operator
import os
from collections.abc import Iterable
from typing import Any

I32 = (-(2**31), 2**31 - 1)
I64 = (-(2**63), 2**63 - 1)
U32 = (0, 2**32 - 1)
IMAGE_TYPES = (bytes, bytearray, memoryview, str, os.PathLike)


def _is_int(v: Any) -> bool:
    if isinstance(v, bool):
        return False
    try:
        operator.index(v)  # int, numpy's integers
    except TypeError:
        return False
    return True


def integer(name: str, v: Any, bounds: tuple[int, int] = I32) -> int:
    """`v` as an int within the proto field's `bounds`."""
    if not _is_int(v):
        raise TypeError(f"{name} must be an integer, not {type(v).__name__} {v!r}")
    n = operator.index(v)
    if not bounds[0] <= n <= bounds[1]:
        raise ValueError(f"{name} must be an integer in [{bounds[0]}, {bounds[1]}], not {n}")
    return n


def number(name: str, v: Any) -> float:
    """`v` (an int or a float) as a float."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name} must be a number, not {type(v).__name__} {v!r}")
    return float(v)


def flag(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be True or False, not {type(v).__name__} {v!r}")
    return v


def text(name: str, v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"{name} must be a str, not {type(v).__name__} {v!r}")
    return v


def token_ids(name: str, v: Any) -> list[int]:
    """A list (or any iterable but a str, bytes or dict) of token ids, each an int32."""
    if isinstance(v, (str, bytes, bytearray, dict)) or _is_int(v) or not isinstance(v, Iterable):
        raise TypeError(f"{name} must be a list of token ids (integers), not {type(v).__name__} {v!r}")
    return [integer(f"{name}[{i}]", t) for i, t in enumerate(v)]


def strings(name: str, v: Any) -> list[str]:
    """One str, or a list of them."""
    if isinstance(v, str):
        return [v]
    if isinstance(v, (bytes, bytearray, dict)) or not isinstance(v, Iterable):
        raise TypeError(f"{name} must be a str or a list of str, not {type(v).__name__} {v!r}")
    return [text(f"{name}[{i}]", s) for i, s in enumerate(v)]


def images(v: Any) -> list:
    """A list of images, each encoded bytes, a file path (str or os.PathLike) or a URL; one image
    given alone (not in a list) is a list of one."""
    if isinstance(v, IMAGE_TYPES):
        return [v]
    if isinstance(v, dict) or not isinstance(v, Iterable):
        raise TypeError(
            f"images must be a list of images (each bytes, a file path or a URL), not {type(v).__name__} {v!r}"
        )
    out = list(v)
    for i, x in enumerate(out):
        if not isinstance(x, IMAGE_TYPES):
            raise TypeError(f"images[{i}] must be bytes, a file path or a URL, not {type(x).__name__}")
    return out


def logit_bias(v: Any) -> dict[int, float]:
    if not isinstance(v, dict):
        raise TypeError(f"logit_bias must be a dict of token id -> bias, not {type(v).__name__} {v!r}")
    out = {}
    for t, b in v.items():
        if isinstance(t, str) and t.lstrip("-").isdigit():  # {"123": 5}, as OpenAI's JSON bodies have it
            t = int(t)
        out[integer("logit_bias's token ids", t)] = number(f"logit_bias[{t!r}]", b)
    return out


def timeout(v: Any) -> float | None:
    """A call's deadline in seconds (None: none); 0 or less: already past."""
    return None if v is None else number("timeout", v)

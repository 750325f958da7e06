"""The installed pdserve's version, as `pdserve --version` and `GET /version` report it."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def pdserve_version() -> str:
    try:
        return version("pdserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"

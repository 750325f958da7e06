"""Transfer tests: pooled host processes for the multi-process tests, and the `slow` tier
(TP 4 pairs), which runs only with PDSERVE_SLOW=1 (tests/conftest.py skips it too)."""

import os

import pytest


@pytest.fixture(scope="session")
def hosts():
    from tests.helpers.xfer_harness import HostPool  # noqa: PLC0415

    pool = HostPool()
    yield pool
    pool.close()


def pytest_runtest_setup(item):
    if item.get_closest_marker("slow") and os.environ.get("PDSERVE_SLOW") != "1":
        pytest.skip("slow tier: set PDSERVE_SLOW=1 to run")

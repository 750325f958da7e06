"""The router's per-request log line (router/request.py Trace.log): its level by how the request ended."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    "finish,level",
    [("length", "INFO"), ("INVALID_ARGUMENT", "INFO"), ("UNAVAILABLE", "WARNING"), ("INTERNAL", "WARNING")],
)
def test_a_request_the_cluster_failed_is_logged_as_a_warning(caplog, finish, level):
    """The per-request line: INFO, but WARNING when the cluster failed the request (a node gone,
    an internal error), so that an operator's WARNING filter shows it; a client's bad request stays INFO."""
    import logging

    from router.request import Trace

    with caplog.at_level(logging.INFO, logger="pdserve.router"):
        Trace("r1", finish=finish).log()
    (rec,) = [r for r in caplog.records if r.getMessage().startswith("request r1:")]
    assert rec.levelname == level

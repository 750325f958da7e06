"""The client Service of several routers pins a client to one of them: each router keeps only the
/v1/responses it answered (router/responses_store.py), so with the Service balancing connections
across two routers a follow-up naming `previous_response_id` found the other router about half
the time and got 400 previous_response_not_found."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.k8s_render import render

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
TARGETS = [K8S / "base", *sorted((K8S / "overlays").iterdir())]


@pytest.mark.parametrize("target", TARGETS, ids=[str(t.relative_to(K8S)) for t in TARGETS])
def test_a_client_stays_with_the_router_that_holds_its_responses(target):
    objs = render(target)
    (router,) = [o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "pdserve-router"]
    (svc,) = [o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "pdserve-router"]
    assert router["spec"]["replicas"] > 1  # more than one router: where a stored response is matters
    assert svc["spec"].get("sessionAffinity") == "ClientIP", svc["spec"]
    # longer than a conversation's pauses (Kubernetes' own default, 3 h), and within its 1-day bound
    assert 3600 <= svc["spec"]["sessionAffinityConfig"]["clientIP"]["timeoutSeconds"] <= 86400

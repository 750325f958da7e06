"""The liveness probes' timings: every component's names its timeout (Kubernetes' default is 1 s,
which a router busy with a burst can miss, and a killed router drops every stream), the same for
all of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.k8s_render import render

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
TARGETS = [K8S / "base", *sorted((K8S / "overlays").iterdir())]


@pytest.mark.parametrize("target", TARGETS, ids=[str(t.relative_to(K8S)) for t in TARGETS])
def test_every_liveness_probe_names_one_timeout(target):
    timeouts = {}
    for o in render(target):
        if o["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for c in o["spec"]["template"]["spec"]["containers"]:
            if "livenessProbe" in c:
                timeouts[c["name"]] = c["livenessProbe"].get("timeoutSeconds")
    assert set(timeouts) >= {"router", "prefill", "decode"}, timeouts
    assert None not in timeouts.values() and len(set(timeouts.values())) == 1, timeouts

"""The images the manifests run: each node pool the overlay's (`pdserve:cpu` on cpu-dev,
`pdserve:cuda` on gpu and its variants), the router the CPU image everywhere (it uses no GPU:
the gpu overlay pulled gigabytes of CUDA image for it), named `pdserve-router` in the base."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.k8s_render import render

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
TARGETS = [K8S / "base", *sorted((K8S / "overlays").iterdir())]


@pytest.mark.parametrize("target", TARGETS, ids=[str(t.relative_to(K8S)) for t in TARGETS])
def test_nodes_run_the_overlays_image_and_the_router_the_cpu_one(target):
    flavour = "base" if target.name == "base" else "gpu" if target.name.startswith("gpu") else "cpu"
    node_image = {"base": "pdserve", "cpu": "pdserve:cpu", "gpu": "pdserve:cuda"}[flavour]
    seen = set()
    for o in render(target):
        if o["kind"] not in ("Deployment", "StatefulSet"):
            continue
        spec = o["spec"]["template"]["spec"]
        component = next(c for c in ("router", "prefill", "decode") if c in o["metadata"]["name"])
        want = ("pdserve-router" if flavour == "base" else "pdserve:cpu") if component == "router" else node_image
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            if c["image"].split(":")[0].startswith("pdserve"):
                assert c["image"] == want, (o["metadata"]["name"], c["name"], c["image"])
                seen.add(component)
    assert seen == {"router", "prefill", "decode"}, seen

"""deploy/k8s: the model options every server must agree on, read from the rendered manifests'
args as the real `pdserve` parser reads them (the rendering and parsing of tests/deploy/test_manifests.py):

- the router and both pools name the same first --served-model-name, the model_name label of
  every server's vllm:* series (vLLM's dashboards filter every panel by one)."""

from __future__ import annotations

from tests.deploy.test_manifests import COMPONENTS, _servers, parser, rendered

__all__ = ["parser", "rendered"]  # the module-scoped fixtures, shared


def test_every_server_labels_its_series_with_one_served_name(rendered, parser):
    name, objs = rendered
    served = {component: ns.served_model_name for component, _, _, ns in _servers(parser, objs)}
    assert set(served) == set(COMPONENTS)
    firsts = {component: names[0] if names else None for component, names in served.items()}
    assert None not in firsts.values(), f"{name}: a server with no --served-model-name: {firsts}"
    assert len(set(firsts.values())) == 1, f"{name}: the servers' first --served-model-name differ: {firsts}"

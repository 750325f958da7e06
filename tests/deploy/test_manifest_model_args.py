"""deploy/k8s: the model options every server must agree on, read from the rendered manifests'
args as the real `pdserve` parser reads them (the rendering and parsing of tests/deploy/test_manifests.py):

- the router and both pools name the same first --served-model-name, the model_name label of
  every server's vllm:* series (vLLM's dashboards filter every panel by one);
- the router and both pools take --hf-overrides from the ConfigMap's HF_OVERRIDES, one value for
  all (a JSON object; {} in every target), and a rotary override written there (YaRN, or vLLM's
  removed --rope-theta spelling added to the args) reaches every server's model: the container's
  command line, through the CLI's own rewrite and parser, gives a node config whose model has the
  YaRN scaling and the longer context, and the router the same override."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from router import vllm_flags
from tests.deploy.test_manifests import (
    COMPONENTS,
    ROOT,
    _container,
    _env,
    _expand,
    _find,
    _servers,
    _workload,
    parser,
    rendered,
)
from tests.helpers import hybrid_ckpt as hc
from tests.helpers.k8s_render import render

__all__ = ["parser", "rendered"]  # the module-scoped fixtures, shared


def test_every_server_labels_its_series_with_one_served_name(rendered, parser):
    name, objs = rendered
    served = {component: ns.served_model_name for component, _, _, ns in _servers(parser, objs)}
    assert set(served) == set(COMPONENTS)
    firsts = {component: names[0] if names else None for component, names in served.items()}
    assert None not in firsts.values(), f"{name}: a server with no --served-model-name: {firsts}"
    assert len(set(firsts.values())) == 1, f"{name}: the servers' first --served-model-name differ: {firsts}"


def test_every_server_reads_the_same_hf_overrides(rendered, parser):
    name, objs = rendered
    given = {component: ns.hf_overrides for component, _, _, ns in _servers(parser, objs)}
    assert None not in given.values(), f"{name}: a server without --hf-overrides: {given}"
    assert len(set(given.values())) == 1, f"{name}: the servers read different --hf-overrides: {given}"
    assert isinstance(json.loads(next(iter(given.values()))), dict)


ORIGINAL = 64
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}


def _command_line(objs: list[dict], component: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The server container's args as the kubelet expands them, then as `pdserve` rewrites them."""
    c = _container(_workload(objs, component), component)
    return vllm_flags.rewrite([_expand(a, _env(objs, c)) for a in [*c["args"], *extra]])


@pytest.mark.parametrize(
    ("value", "extra", "want"),
    [
        (json.dumps({"rope_parameters": YARN}), (), {"rope_parameters": YARN}),
        # a recipe's --rope-theta beside the ConfigMap's override: merged into one --hf-overrides
        (json.dumps({"rope_parameters": YARN}), ("--rope-theta=500000",), {"rope_parameters": YARN, "rope_theta": 5e5}),
    ],
    ids=["yarn", "yarn+rope-theta"],
)
def test_a_rope_override_in_the_configmap_reaches_every_server(tmp_path, parser, value, extra, want):
    from decode_node.config import DecodeNodeConfig
    from prefill_node.config import PrefillNodeConfig

    ckpt = hc.make(tmp_path / "ckpt", dataclasses.replace(hc.SPEC_HV2, layers=4, max_positions=ORIGINAL))
    objs = copy.deepcopy(render(Path(ROOT) / "deploy" / "k8s" / "base"))
    _find(objs, "ConfigMap", "pdserve-config")["data"]["HF_OVERRIDES"] = value
    for component, cls in (("router", None), ("prefill", PrefillNodeConfig), ("decode", DecodeNodeConfig)):
        ns = parser.parse_args(_command_line(objs, component, extra))
        assert json.loads(ns.hf_overrides) == want, component
        if cls is None:
            continue
        # a context 4x the checkpoint's starts only with the YaRN factor read
        ecfg = cls(model=ckpt, hf_overrides=ns.hf_overrides, max_model_len=ORIGINAL * 4).engine_config(check_only=True)
        assert (ecfg.model.rope_scaling.kind, ecfg.model.rope_scaling.factor) == ("yarn", 4.0), component
        assert ecfg.max_model_len == ORIGINAL * 4, component
        if "rope_theta" in want:
            assert ecfg.model.rope_theta == 5e5, component
    with pytest.raises(ValueError, match="max_model_len"):  # the same context without it is refused
        PrefillNodeConfig(model=ckpt, max_model_len=ORIGINAL * 4).engine_config(check_only=True)

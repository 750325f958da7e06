"""tests/helpers/k8s_render.py, the offline kustomize the manifest tests render with: strategic
merge and JSON 6902 patches as kustomize applies them, refusing what it does not implement."""

from __future__ import annotations

import pytest

from tests.helpers.k8s_render import RenderError, json6902, strategic_merge


def test_strategic_merge_semantics():
    base = {
        "containers": [{"name": "a", "args": ["x", "y"], "resources": {"requests": {"cpu": "1"}}}, {"name": "b"}],
        "volumes": [{"name": "m", "persistentVolumeClaim": {"claimName": "c"}}],
        "tolerations": [{"key": "k1"}],
    }
    patch = {
        "containers": [{"name": "a", "args": ["z"], "resources": {"requests": {"memory": "1Gi"}}}, {"name": "c"}],
        "volumes": [{"name": "m", "persistentVolumeClaim": None, "emptyDir": {}}],
        "tolerations": [{"key": "k2"}],
    }
    out = strategic_merge(base, patch)
    assert out["containers"] == [
        {"name": "a", "args": ["z"], "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}},
        {"name": "b"},
        {"name": "c"},
    ]
    assert out["volumes"] == [{"name": "m", "emptyDir": {}}]
    assert out["tolerations"] == [{"key": "k2"}]
    assert base["volumes"][0]["persistentVolumeClaim"] == {"claimName": "c"}  # inputs unchanged
    with pytest.raises(RenderError):
        strategic_merge(base, {"containers": [{"$patch": "delete", "name": "a"}]})


def test_json6902_semantics():
    obj = {"a": {"list": [1, 2], "x": {"y": 1}}, "b/c": {"~d": 0}}
    out = json6902(
        obj,
        [
            {"op": "add", "path": "/a/list/-", "value": 3},
            {"op": "add", "path": "/a/list/0", "value": 0},
            {"op": "remove", "path": "/a/x/y"},
            {"op": "add", "path": "/a/x/z", "value": {"p": 1}},
            {"op": "replace", "path": "/b~1c/~0d", "value": 5},
        ],
    )
    assert out == {"a": {"list": [0, 1, 2, 3], "x": {"z": {"p": 1}}}, "b/c": {"~d": 5}}
    assert obj["a"]["list"] == [1, 2]  # input unchanged
    for bad in (
        {"op": "remove", "path": "/a/missing"},
        {"op": "replace", "path": "/a/list/5", "value": 0},
        {"op": "add", "path": "/nope/x", "value": 0},
        {"op": "move", "from": "/a", "path": "/c"},
    ):
        with pytest.raises(RenderError):
            json6902(obj, [bad])

"""A small stand-in for `kubectl kustomize`, for the tests (kubectl is not installed here).

It renders a kustomization directory the way kustomize does for the features deploy/k8s uses,
and refuses any other feature so that a new one cannot be silently mis-rendered:

- `resources`: YAML files (one or more documents) and directories holding a kustomization.yaml,
  rendered in order;
- `namespace`: set on every namespaced object (a Namespace object is renamed to it, as kustomize
  does);
- `images`: `name` -> `newName` / `newTag` on containers and init containers;
- `patches` with `path`: strategic merge patches, the target found by kind and metadata.name.

Strategic merge, as Kubernetes defines it for these fields: maps merge key by key, a null value
deletes the key, lists of containers / initContainers / volumes / env / imagePullSecrets merge by
`name`, volumeMounts by `mountPath`, container ports by `containerPort`, Service ports by `port`;
any other list is replaced.
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "namespace", "images", "patches"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass"}
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "env": "name",
    "imagePullSecrets": "name",
    "volumeMounts": "mountPath",
}


class RenderError(ValueError):
    pass


def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _merge_key(field: str, items: list) -> str | None:
    if field in MERGE_KEYS:
        return MERGE_KEYS[field]
    if field == "ports" and items and isinstance(items[0], dict):
        return "containerPort" if "containerPort" in items[0] else "port"
    return None


def strategic_merge(base, patch, field: str = ""):
    """Return `base` with `patch` applied (neither argument is changed)."""
    if isinstance(patch, dict):
        for k in patch:
            if k.startswith("$"):
                raise RenderError(f"patch directive {k!r} is not supported by this renderer")
        if not isinstance(base, dict):
            return copy.deepcopy({k: v for k, v in patch.items() if v is not None})
        out = copy.deepcopy(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = strategic_merge(out[k], v, k)
            else:
                out[k] = strategic_merge(None, v, k)
        return out
    if isinstance(patch, list):
        key = _merge_key(field, patch or base or [])
        if key is None or not isinstance(base, list):
            return copy.deepcopy(patch)
        out = copy.deepcopy(base)
        for item in patch:
            if not isinstance(item, dict) or key not in item:
                raise RenderError(f"{field}: every patch item needs its merge key {key!r}: {item!r}")
            for i, cur in enumerate(out):
                if cur.get(key) == item[key]:
                    out[i] = strategic_merge(cur, item, field)
                    break
            else:
                out.append(strategic_merge(None, item, field))
        return out
    return copy.deepcopy(patch)


def _set_image(obj: dict, images: list[dict]) -> None:
    spec = obj.get("spec", {}).get("template", {}).get("spec") or (obj.get("spec") if obj["kind"] == "Pod" else None)
    if not spec:
        return
    for c in [*spec.get("containers", []), *spec.get("initContainers", [])]:
        name, _, tag = c["image"].partition(":")
        for rule in images:
            if rule["name"] == name:
                tag = str(rule.get("newTag", tag))
                c["image"] = rule.get("newName", name) + (":" + tag if tag else "")


def render(directory: str | Path) -> list[dict]:
    """The objects `kubectl kustomize directory` prints, in resource order."""
    d = Path(directory)
    kfile = d / "kustomization.yaml"
    if not kfile.is_file():
        raise RenderError(f"{d}: no kustomization.yaml")
    (k,) = load_docs(kfile)
    unknown = set(k) - KUSTOMIZATION_KEYS
    if unknown:
        raise RenderError(f"{kfile}: unsupported kustomization field(s) {sorted(unknown)}")
    objs: list[dict] = []
    for res in k.get("resources", []):
        p = d / res
        objs.extend(render(p) if p.is_dir() else load_docs(p))
    for entry in k.get("patches", []):
        if set(entry) != {"path"}:
            raise RenderError(f"{kfile}: only `patches: - path: FILE` is supported, got {entry!r}")
        for patch in load_docs(d / entry["path"]):
            hits = [
                i
                for i, o in enumerate(objs)
                if o["kind"] == patch["kind"] and o["metadata"]["name"] == patch["metadata"]["name"]
            ]
            if len(hits) != 1:
                target = f"{patch['kind']}/{patch['metadata']['name']}"
                raise RenderError(f"{entry['path']}: {len(hits)} objects match {target}")
            objs[hits[0]] = strategic_merge(objs[hits[0]], patch)
    for o in objs:
        if k.get("images"):
            _set_image(o, k["images"])
        if k.get("namespace"):
            if o["kind"] == "Namespace":
                o["metadata"]["name"] = k["namespace"]
            elif o["kind"] not in CLUSTER_SCOPED:
                o["metadata"]["namespace"] = k["namespace"]
    return objs

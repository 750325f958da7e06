"""A small stand-in for `kubectl kustomize` for the tests: renders a kustomization the way
kustomize does for the features deploy/k8s uses (resources, namespace, images, strategic merge and
JSON 6902 patches, components) and refuses any other feature (docs/deploy.md, "Module notes")."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "components", "namespace", "images", "patches"}
TARGET_KEYS = {"kind", "name", "labelSelector", "group", "version"}
JSON6902_OPS = {"add", "remove", "replace"}
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


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise RenderError(f"JSON pointer {path!r} must start with /")
    return [t.replace("~1", "/").replace("~0", "~") for t in path[1:].split("/")]


def _index(parent: list, token: str, path: str, append: bool = False) -> int:
    if append and token == "-":
        return len(parent)
    if not token.isdigit() or int(token) >= len(parent) + append:
        raise RenderError(f"{path}: no list index {token!r} (the list has {len(parent)} items)")
    return int(token)


def json6902(obj: dict, ops: list[dict]) -> dict:
    """`obj` with the operations applied in order (obj is not changed); a path that does not
    exist is an error, as in kustomize."""
    out = copy.deepcopy(obj)
    for op in ops:
        kind, path = op.get("op"), op.get("path", "")
        if kind not in JSON6902_OPS:
            raise RenderError(f"JSON 6902 op {kind!r} is not supported by this renderer")
        *parents, last = _pointer(path)
        parent = out
        for t in parents:
            if isinstance(parent, list):
                parent = parent[_index(parent, t, path)]
            elif isinstance(parent, dict) and t in parent:
                parent = parent[t]
            else:
                raise RenderError(f"{path}: no {t!r}")
        value = copy.deepcopy(op.get("value"))
        if isinstance(parent, list):
            i = _index(parent, last, path, append=kind == "add")
            if kind == "add":
                parent.insert(i, value)
            elif kind == "remove":
                del parent[i]
            else:
                parent[i] = value
        elif isinstance(parent, dict):
            if kind != "add" and last not in parent:
                raise RenderError(f"{path}: nothing to {kind}")
            if kind == "remove":
                del parent[last]
            else:
                parent[last] = value
        else:
            raise RenderError(f"{path}: {parents[-1] if parents else '/'} is not an object or a list")
    return out


def _selects(target: dict, o: dict) -> bool:
    group, _, version = o["apiVersion"].rpartition("/")
    labels = o["metadata"].get("labels", {})
    want = dict(kv.split("=", 1) for kv in target["labelSelector"].split(",")) if "labelSelector" in target else {}
    return (
        target.get("kind", o["kind"]) == o["kind"]
        and target.get("name", o["metadata"]["name"]) == o["metadata"]["name"]
        and target.get("group", group) == group
        and target.get("version", version) == version
        and all(labels.get(k.strip()) == v.strip() for k, v in want.items())
    )


def _apply_patches(kfile: Path, objs: list[dict], patches: list[dict]) -> None:
    d = kfile.parent
    for entry in patches:
        if set(entry) == {"path"}:
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
        elif set(entry) == {"path", "target"}:
            target = entry["target"]
            if set(target) - TARGET_KEYS:
                raise RenderError(f"{kfile}: unsupported patch target field(s) {sorted(set(target) - TARGET_KEYS)}")
            (ops,) = load_docs(d / entry["path"])
            if not isinstance(ops, list):
                raise RenderError(f"{entry['path']}: a patch with a target must be a JSON 6902 list of operations")
            hits = [i for i, o in enumerate(objs) if _selects(target, o)]
            if not hits:
                raise RenderError(f"{entry['path']}: no object matches the target {target}")
            for i in hits:
                objs[i] = json6902(objs[i], ops)
        else:
            raise RenderError(f"{kfile}: only `patches: - path: FILE [target: ...]` is supported, got {entry!r}")


def _kustomization(d: Path, kind: str) -> tuple[Path, dict]:
    kfile = d / "kustomization.yaml"
    if not kfile.is_file():
        raise RenderError(f"{d}: no kustomization.yaml")
    (k,) = load_docs(kfile)
    unknown = set(k) - KUSTOMIZATION_KEYS
    if unknown:
        raise RenderError(f"{kfile}: unsupported kustomization field(s) {sorted(unknown)}")
    if k.get("kind", "Kustomization") != kind:
        raise RenderError(f"{kfile}: a {k.get('kind', 'Kustomization')} where a {kind} is expected")
    if kind == "Component" and ("namespace" in k or "images" in k):
        raise RenderError(f"{kfile}: this renderer takes only resources and patches in a Component")
    return kfile, k


def _resources(d: Path, k: dict) -> list[dict]:
    objs: list[dict] = []
    for res in k.get("resources", []):
        p = d / res
        objs.extend(render(p) if p.is_dir() else load_docs(p))
    return objs


def render(directory: str | Path) -> list[dict]:
    """The objects `kubectl kustomize directory` prints, in resource order."""
    d = Path(directory)
    kfile, k = _kustomization(d, "Kustomization")
    objs = _resources(d, k)
    for comp in k.get("components", []):
        cfile, ck = _kustomization(d / comp, "Component")
        objs.extend(_resources(d / comp, ck))
        _apply_patches(cfile, objs, ck.get("patches", []))
    _apply_patches(kfile, objs, k.get("patches", []))
    for o in objs:
        if k.get("images"):
            _set_image(o, k["images"])
        if k.get("namespace"):
            if o["kind"] == "Namespace":
                o["metadata"]["name"] = k["namespace"]
            elif o["kind"] not in CLUSTER_SCOPED:
                o["metadata"]["namespace"] = k["namespace"]
    return objs

"""deploy/: the Kubernetes manifests and the Dockerfiles, checked offline.

`k8s_render.render` does the kustomize build (base + overlay patches, namespace, images) in Python,
so the tests run where kubectl is not installed; it refuses kustomize features it does not
implement. Where kubectl is installed, `kubectl kustomize` renders each target too and the two
must agree (up to the order of volumes and volumeMounts). Every rendered object is validated with kubernetes-validate (strict: unknown fields
fail) against the newest Kubernetes schema the package ships. Then what a schema cannot see:

- each pdserve container's args, with $(VAR) expanded from its ConfigMap and downward-API env as
  the kubelet would, parse with the real `pdserve` argument parser (router.cli.build_parser), so
  every flag exists;
- the ports the servers listen on (--port, or the parser's default where the manifest sets none)
  are the containerPorts and the ports of the startup / readiness / liveness gRPC probes, and the
  readiness probes name services the proto defines;
- every component serves /metrics (--metrics-port) on a declared port that its pod's Prometheus
  annotations name; the router's OpenAI HTTP port (--http-port) is declared and in its Service;
- nodes register with every router pod (StatefulSet DNS names through the headless Service), one
  address per replica, on the router's port; clients use the pdserve-router Service;
- the gpu overlay requests nvidia.com/gpu = --tp for each pool; the others request no GPU;
- every component drains on SIGTERM (--drain-timeout > 0), and any preStop plus the drain plus
  the stop fit in the grace period; one PodDisruptionBudget selects each pool;
- the TLS overlays (components/tls) give every server --tls-cert / --tls-key / --tls-ca naming
  the files of the mounted Secret pdserve-tls and one --tls-server-name, and probe with HTTP
  (Kubernetes' gRPC probe does not speak TLS) on the plain-HTTP metrics port, readiness at
  /health and startup and liveness at /live, with the same timings; the others run no TLS and
  probe with gRPC.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import io
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import kubernetes_validate as kv  # the dev extras
import pytest
import yaml
from kubernetes_validate import utils as kv_utils

from serving.probes import HEALTH, LIVE, PATHS
from tests.helpers.k8s_render import render

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu-dev", "gpu", "cpu-dev-tls", "gpu-tls", "gpu-rdma")  # X-tls: X with components/tls
TARGETS = {"base": K8S / "base", **{o: K8S / "overlays" / o for o in OVERLAYS}}
TLS_DIR = "/etc/pdserve/tls"  # where components/tls mounts Secret pdserve-tls
COMPONENTS = {"router": "Generation", "prefill": "PrefillNode", "decode": "DecodeNode"}  # kind -> served service
POOLS = ("prefill", "decode")
FIELD_REFS = {"metadata.name": "pdserve-x-0", "status.podIP": "10.0.0.7", "metadata.namespace": "ns"}
GPU = "nvidia.com/gpu"


# ---- helpers -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    from router.cli import build_parser

    return build_parser()


def _subparser(parser: argparse.ArgumentParser, cmd: str) -> argparse.ArgumentParser:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[cmd]


def _normalized(objs: list[dict]) -> dict:
    """Objects by (kind, name), volumes and volumeMounts in name order: kustomize puts the items a
    patch touched first, where the Python renderer keeps the base's order; both mean the same."""

    def norm(x, field=""):
        if isinstance(x, dict):
            return {k: norm(v, k) for k, v in x.items()}
        if isinstance(x, list):
            items = [norm(v) for v in x]
            return sorted(items, key=lambda v: v.get("name", "")) if field in ("volumes", "volumeMounts") else items
        return x

    return {(o["kind"], o["metadata"]["name"]): norm(o) for o in objs}


# ids name the directory: a bare "gpu" id would be taken for the `gpu` marker and skipped
@pytest.fixture(scope="module", params=list(TARGETS), ids=[str(p.relative_to(K8S)) for p in TARGETS.values()])
def rendered(request) -> tuple[str, list[dict]]:
    """The Python rendering; where kubectl is installed, also `kubectl kustomize`, which must agree."""
    objs = render(TARGETS[request.param])
    kubectl = shutil.which("kubectl")
    if kubectl:
        out = subprocess.run(
            [kubectl, "kustomize", str(TARGETS[request.param])], capture_output=True, text=True, timeout=60, check=True
        ).stdout
        real = [d for d in yaml.safe_load_all(out) if d is not None]
        assert _normalized(real) == _normalized(objs), f"k8s_render and kubectl kustomize differ on {request.param}"
    return request.param, objs


def _flavour(name: str) -> str:
    """The target a TLS or RDMA overlay adds to ("gpu-tls" -> "gpu", "gpu-rdma" -> "gpu")."""
    return name.removesuffix("-tls").removesuffix("-rdma")


def _find(objs: list[dict], kind: str, name: str) -> dict:
    hits = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(hits) == 1, f"{len(hits)} {kind}/{name} in the rendered manifests"
    return hits[0]


def _workload(objs: list[dict], component: str) -> dict:
    hits = [
        o
        for o in objs
        if o["kind"] in ("Deployment", "StatefulSet")
        and o["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]
    assert len(hits) == 1, f"{len(hits)} workloads for {component}"
    return hits[0]


def _container(obj: dict, name: str) -> dict:
    (c,) = [c for c in obj["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return c


def _env(objs: list[dict], c: dict) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom first, then env."""
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        env.update(_find(objs, "ConfigMap", src["configMapRef"]["name"])["data"])
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = FIELD_REFS[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            ref = e["valueFrom"]["configMapKeyRef"]
            env[e["name"]] = _find(objs, "ConfigMap", ref["name"])["data"][ref["key"]]
    return env


def _expand(arg: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def _parse(parser, objs, c: dict) -> argparse.Namespace:
    args = [_expand(a, _env(objs, c)) for a in [*c.get("command", [])[1:], *c.get("args", [])]]
    unresolved = [a for a in args if "$(" in a]
    assert not unresolved, f"{c['name']}: variables with no value in the container's env: {unresolved}"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(args)
    except SystemExit:
        pytest.fail(f"{c['name']}: `pdserve {' '.join(args)}` does not parse: {err.getvalue().strip()}")


def _servers(parser, objs):
    """(component, workload, its server container, the container's parsed args) for each component."""
    for component in COMPONENTS:
        w = _workload(objs, component)
        c = _container(w, component)
        yield component, w, c, _parse(parser, objs, c)


IMAGES = ("pdserve", "pdserve-router")  # the router's, in the base (tests/deploy/test_images.py)


def _pdserve_containers(obj: dict) -> list[dict]:
    spec = obj["spec"]["template"]["spec"]
    return [c for c in [*spec.get("initContainers", []), *spec["containers"]] if c["image"].split(":")[0] in IMAGES]


# ---- schema --------------------------------------------------------------------------------
def test_every_rendered_object_validates(rendered):
    name, objs = rendered
    version = kv_utils.latest_version()
    assert tuple(int(x) for x in version.split(".")[:2]) >= (1, 33), f"kubernetes-validate ships only {version}"
    for o in objs:
        try:
            kv.validate(o, version, strict=True)
        except kv_utils.ValidationError as e:
            pytest.fail(f"{name}: {o['kind']}/{o['metadata']['name']} fails Kubernetes {version}: {e.message}")
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objs)
    for want in [("ConfigMap", "pdserve-config"), ("StatefulSet", "pdserve-router"), ("Service", "pdserve-router")]:
        assert want in kinds
    for pool in POOLS:
        assert ("StatefulSet", f"pdserve-{pool}") in kinds and ("PodDisruptionBudget", f"pdserve-{pool}") in kinds


def test_selectors_match_their_pods_and_volumes_exist(rendered):
    name, objs = rendered
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet"):
            labels = o["spec"]["template"]["metadata"]["labels"]
            assert o["spec"]["selector"]["matchLabels"].items() <= labels.items(), o["metadata"]["name"]
            spec = o["spec"]["template"]["spec"]
            vols = {v["name"]: v for v in spec.get("volumes", [])}
            for c in [*spec.get("initContainers", []), *spec["containers"]]:
                for m in c.get("volumeMounts", []):
                    assert m["name"] in vols, f"{o['metadata']['name']}/{c['name']}: no volume {m['name']}"
            for v in vols.values():
                claim = v.get("persistentVolumeClaim", {}).get("claimName")
                if claim and name != "base":  # the base leaves the claim to the overlay
                    _find(objs, "PersistentVolumeClaim", claim)
            if o["kind"] == "StatefulSet":
                _find(objs, "Service", o["spec"]["serviceName"])


# ---- the servers' real flags and ports -----------------------------------------------------
def test_args_parse_with_the_pdserve_cli(rendered, parser):
    name, objs = rendered
    for component in COMPONENTS:
        w = _workload(objs, component)
        for c in _pdserve_containers(w):
            ns = _parse(parser, objs, c)
            if c["name"] == component:
                assert ns.cmd == component
                model_mounts = [m["mountPath"] for m in c["volumeMounts"] if m["name"] == "models"]
                assert any(ns.model.startswith(p.rstrip("/") + "/") for p in model_mounts), (ns.model, model_mounts)
            else:  # cpu-dev's init container writes the checkpoint the servers read
                assert ns.cmd == "make-tiny-model" and ns.dir == _parse(parser, objs, _container(w, component)).model


def test_probes_name_the_ports_the_servers_listen_on(rendered, parser):
    from proto import pb

    name, objs = rendered
    for component, service in COMPONENTS.items():
        c = _container(_workload(objs, component), component)
        ns = _parse(parser, objs, c)
        default = _subparser(parser, component).get_default("port")
        if component == "router":
            assert ns.port == default == 50051, "the router listens on its CLI default port"
        else:
            assert default == 0 and ns.port > 0, f"{component}: the CLI default port is random; set a fixed --port"
        assert ns.host == "0.0.0.0", f"{component} must bind every interface to be reachable from other pods"
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["grpc"] == ns.port
        if ns.tls_cert:  # test_tls_overlay checks those probes
            continue
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert _probe_port(c, probe) == ns.port, f"{name}: {component} {probe} port != --port {ns.port}"
        full = c["readinessProbe"]["grpc"].get("service", "")
        assert full == pb.DESCRIPTOR.services_by_name[service].full_name
        assert "service" not in c["livenessProbe"]["grpc"]  # "" is the server's overall health


def _probe_port(c: dict, probe: str) -> int:
    """The port a gRPC or TCP probe checks (a named port resolved to the container's)."""
    (how,) = [k for k in ("grpc", "tcpSocket", "httpGet", "exec") if k in c[probe]]
    port = c[probe][how]["port"]
    if isinstance(port, str):
        (port,) = [p["containerPort"] for p in c["ports"] if p["name"] == port]
    return port


def test_pools_agree_on_what_sizes_the_transferred_state(rendered, parser):
    """The transfer handshake refuses pools whose state pools differ: dtype, block size and the
    speculative draft count must be the same on both sides."""
    name, objs = rendered
    pre, dec = (_parse(parser, objs, _container(_workload(objs, pool), pool)) for pool in POOLS)
    for flag in ("dtype", "block_size", "num_speculative_tokens", "model"):
        assert getattr(pre, flag) == getattr(dec, flag), f"{name}: prefill and decode differ in --{flag}"


def test_metrics_and_http_ports_are_declared_and_scraped(rendered, parser):
    name, objs = rendered
    for component, w, c, ns in _servers(parser, objs):
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ns.metrics_port and ports["metrics"] == ns.metrics_port, f"{name}: {component} metrics port"
        ann = w["spec"]["template"]["metadata"].get("annotations", {})
        assert ann.get("prometheus.io/scrape") == "true", f"{name}: {component} is not scraped"
        assert ann.get("prometheus.io/port") == str(ns.metrics_port) and ann.get("prometheus.io/path") == "/metrics"
        want = {"grpc", "metrics"} | ({"http"} if component == "router" else set())
        assert set(ports) == want, f"{name}: {component} declares {sorted(ports)}"
        assert len(set(ports.values())) == len(ports), f"{name}: {component} uses one port twice"
        if component == "router":
            assert ns.http_port and ports["http"] == ns.http_port
            svc = _find(objs, "Service", w["metadata"]["name"])
            assert any(sp.get("targetPort") == "http" for sp in svc["spec"]["ports"]), "the Service has no HTTP port"


def _target_port(svc_port: dict, container: dict) -> int:
    target = svc_port.get("targetPort", svc_port["port"])
    if isinstance(target, str):
        (target,) = [p["containerPort"] for p in container["ports"] if p.get("name") == target]
    return target


def test_nodes_register_with_every_router(rendered, parser):
    """Nodes register with each router pod by its StatefulSet DNS name (through the headless
    Service), one address per replica, on the router's port; clients use the pdserve-router Service."""
    name, objs = rendered
    router = _workload(objs, "router")
    rc = _container(router, "router")
    router_port = _parse(parser, objs, rc).port
    pod_labels = router["spec"]["template"]["metadata"]["labels"].items()
    svc = _find(objs, "Service", "pdserve-router")  # clients
    assert svc["spec"]["selector"].items() <= pod_labels
    assert [_target_port(sp, rc) for sp in svc["spec"]["ports"] if sp["name"] == "grpc"] == [router_port]
    assert router["kind"] == "StatefulSet"
    pods = _find(objs, "Service", router["spec"]["serviceName"])
    assert pods["spec"].get("clusterIP") == "None" and pods["spec"]["selector"].items() <= pod_labels
    want = [f"{router['metadata']['name']}-{i}.{pods['metadata']['name']}" for i in range(router["spec"]["replicas"])]
    for pool in POOLS:
        w = _workload(objs, pool)
        ns = _parse(parser, objs, _container(w, pool))
        addrs = [a.rpartition(":") for a in ns.router.split(",")]
        assert [h for h, _, _ in addrs] == want, f"{name}: {pool} --router {ns.router} is not every router pod"
        for _, _, port in addrs:
            (sp,) = [p for p in pods["spec"]["ports"] if p["port"] == int(port)]
            assert _target_port(sp, rc) == router_port
        # the router dials the pod IP it is given, under the pod's stable StatefulSet name
        assert w["kind"] == "StatefulSet"
        assert ns.advertise_host == FIELD_REFS["status.podIP"] and ns.node_id == FIELD_REFS["metadata.name"]


def test_gpu_requests_equal_tp_in_the_gpu_overlay_only(rendered, parser):
    name, objs = rendered
    assert (
        _workload(objs, "router")["spec"]["template"]["spec"]["containers"][0]
        .get("resources", {})
        .get("limits", {})
        .get(GPU)
        is None
    )
    for pool in POOLS:
        c = _container(_workload(objs, pool), pool)
        ns = _parse(parser, objs, c)
        res = c.get("resources", {})
        if _flavour(name) == "gpu":
            assert ns.device == "cuda"
            assert int(res["limits"][GPU]) == ns.tp == int(res["requests"].get(GPU, ns.tp)), (pool, res, ns.tp)
        else:
            assert ns.device == "cpu" and GPU not in res.get("limits", {}) and GPU not in res.get("requests", {})


def test_graceful_termination(rendered, parser):
    name, objs = rendered
    for component, w, c, ns in _servers(parser, objs):
        assert ns.drain_timeout > 0, f"{component} must drain on SIGTERM"
        pre = 0
        if "lifecycle" in c:
            cmd = c["lifecycle"]["preStop"]["exec"]["command"]
            assert cmd[0] == "sleep", cmd
            pre = int(cmd[1])
        # preStop, then the drain (at most --drain-timeout), then the stop: 2 s of gRPC grace + up
        # to 5 s (+ the engine loop's join, up to 30 s, on nodes); the grace period covers them all.
        budget = pre + ns.drain_timeout + (7 if component == "router" else 37)
        assert w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= budget, component


def test_one_disruption_budget_per_pool(rendered):
    name, objs = rendered
    pdbs = [o for o in objs if o["kind"] == "PodDisruptionBudget"]
    for pool in POOLS:
        labels = _workload(objs, pool)["spec"]["template"]["metadata"]["labels"]
        hits = [p for p in pdbs if p["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert len(hits) == 1, f"{pool}: {len(hits)} PodDisruptionBudgets select it"


# ---- Dockerfiles ---------------------------------------------------------------------------
def _dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether a .dockerignore's patterns leave `path` out of the build context (the last
    matching pattern decides; `!` lets a path back in; a directory pattern covers what is under it)."""
    out = False
    for raw in (p.strip() for p in patterns):
        if not raw or raw.startswith("#"):
            continue
        pat = raw.lstrip("!").rstrip("/")
        if pat == "**" or fnmatch.fnmatch(path, pat) or path.startswith(pat + "/"):
            out = not raw.startswith("!")
    return out


@pytest.mark.parametrize("flavour", ["cpu", "cuda"], ids=["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfile_installs_the_project_as_a_non_root_pdserve(flavour):
    text = (ROOT / "deploy" / "docker" / f"Dockerfile.{flavour}").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert py["project"]["scripts"]["pdserve"] == "router.cli:main"
    copied = {ln.split()[1].rstrip("/") for ln in lines if ln.startswith("COPY ")}
    for pattern in py["tool"]["setuptools"]["packages"]["find"]["include"]:
        assert pattern.rstrip("*") in copied, f"Dockerfile.{flavour} does not copy the {pattern} packages"
    assert {"pyproject.toml", "README.md"} <= {w for ln in lines if ln.startswith("COPY ") for w in ln.split()[1:-1]}
    # every source the build copies from the context gets through the flavour's .dockerignore
    ignore = (ROOT / "deploy" / "docker" / f"Dockerfile.{flavour}.dockerignore").read_text().split("\n")
    for ln in lines:
        if ln.startswith("COPY ") and "--from=" not in ln:
            for src in ln.split()[1:-1]:
                probe = src + "__init__.py" if src.endswith("/") else src
                assert not _dockerignored(probe, ignore), f"Dockerfile.{flavour}.dockerignore leaves out {src}"
    # torch from the flavour's wheel index before the project, so pip keeps that build
    i_torch = next(i for i, ln in enumerate(lines) if 'pip install "${TORCH}" --index-url' in ln)
    i_proj = next(i for i, ln in enumerate(lines) if "pip install ." in ln)
    assert i_torch < i_proj
    user = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert user and user[-1].split(":")[0].isdigit() and user[-1].split(":")[0] != "0"
    assert [ln for ln in lines if ln.startswith("ENTRYPOINT")] == ['ENTRYPOINT ["pdserve"]']
    if flavour == "cpu":
        assert any(ln.startswith("FROM python:3.11-slim") for ln in lines)
        assert "download.pytorch.org/whl/cpu" in text
    else:
        assert "FROM ${CUDA_IMAGE}" in lines and re.search(r"CUDA_IMAGE=nvidia/cuda:[\d.]+-\S*runtime", text)


# ---- secrets -------------------------------------------------------------------------------
def _secret_file(w: dict, c: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) of the file at `path` in container c, mounted from a secret volume."""
    vols = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
    for m in c.get("volumeMounts", []):
        prefix = m["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix) and "secret" in vols[m["name"]]:
            assert m.get("readOnly"), f"{c['name']}: {m['mountPath']} is writable"
            sec = vols[m["name"]]["secret"]
            rel = path[len(prefix) :]
            items = {i["path"]: i["key"] for i in sec.get("items", [])} or {rel: rel}
            assert rel in items, f"{c['name']}: {path} is not a key of Secret {sec['secretName']}"
            assert sec.get("defaultMode", 0o644) & 0o007 == 0, f"{sec['secretName']} is world-readable"
            return sec["secretName"], items[rel]
    raise AssertionError(f"{c['name']}: {path} is not in a mounted Secret")


def test_the_cluster_token_and_api_keys_come_from_secrets(rendered, parser):
    """Every server joins with the cluster token (a file from Secret pdserve-cluster-token), none
    runs the node plane open; the router reads the client API keys from Secret pdserve-api-keys.
    No secret is in the ConfigMap or on a command line."""
    name, objs = rendered
    for component, w, c, ns in _servers(parser, objs):
        assert not ns.insecure_open_cluster, f"{name}: {component} runs the node plane open"
        assert _secret_file(w, c, ns.cluster_token_file) == ("pdserve-cluster-token", "token"), component
        if component == "router":
            assert _secret_file(w, c, ns.api_key_file) == ("pdserve-api-keys", "keys")
            assert not ns.api_key, f"{name}: an API key on the router's command line"
    config = _find(objs, "ConfigMap", "pdserve-config")["data"]
    assert not [k for k in config if k.endswith(("_TOKEN", "_KEY", "_KEYS"))], f"{name}: a secret in the ConfigMap"


# ---- TLS -----------------------------------------------------------------------------------
def test_tls_overlay(rendered, parser):
    """components/tls: every server gets --tls-cert / --tls-key / --tls-ca naming the files of
    the Secret pdserve-tls it mounts, and the shared --tls-server-name; no probe uses gRPC: each
    asks the metrics port's /health or /live over plain HTTP, with the timings the overlay without
    TLS gives it. Without the component nothing has TLS."""
    name, objs = rendered
    plain = render(TARGETS[_flavour(name)])
    for component, w, c, ns in _servers(parser, objs):
        flags = (ns.tls_cert, ns.tls_key, ns.tls_ca, ns.tls_server_name)
        if not name.endswith("-tls"):
            assert flags == (None,) * 4, f"{name}: {component} has TLS flags {flags}"
            assert all("grpc" in c[p] for p in ("startupProbe", "readinessProbe", "livenessProbe"))
            continue
        files = {"tls.crt": ns.tls_cert, "tls.key": ns.tls_key, "ca.crt": ns.tls_ca}
        for key, path in files.items():
            assert path == f"{TLS_DIR}/{key}", f"{name}: {component} reads {key} from {path}"
            assert _secret_file(w, c, path) == ("pdserve-tls", key), f"{name}: {component} {path}"
        assert ns.tls_server_name == _find(objs, "ConfigMap", "pdserve-config")["data"]["TLS_SERVER_NAME"]
        # the base's args are all still there, the TLS flags after them
        base_args = _container(_workload(plain, component), component)["args"]
        assert c["args"][: len(base_args)] == base_args and len(c["args"]) == len(base_args) + 4
        before = _container(_workload(plain, component), component)
        for probe, path in (("startupProbe", LIVE), ("readinessProbe", HEALTH), ("livenessProbe", LIVE)):
            kept = {k: v for k, v in c[probe].items() if k != "httpGet"}
            assert kept == {k: v for k, v in before[probe].items() if k != "grpc"}, f"{name}: {component} {probe}"
            # plain HTTP on the metrics port, a path it serves (serving/probes.py)
            assert "grpc" not in c[probe] and _probe_port(c, probe) == ns.metrics_port, f"{name}: {component}"
            assert c[probe]["httpGet"]["path"] == path and path in PATHS
            assert c[probe]["httpGet"].get("scheme", "HTTP") == "HTTP"
        # the init container (cpu-dev's model maker) serves nothing and gets no TLS
        for ic in w["spec"]["template"]["spec"].get("initContainers", []):
            assert not any(a.startswith("--tls") for a in ic.get("args", []))


RDMA = "rdma/rdma_shared_device_a"


def test_rdma_overlay_gives_the_pools_a_device_and_ipc_lock(rendered, parser):
    """gpu-rdma only: each node pool requests and is limited to one RDMA device and may lock
    memory (the NIC registers it); the router asks for neither; no pool is let stage GPU memory
    over TCP."""
    name, objs = rendered
    rdma = name == "gpu-rdma"
    router = _workload(objs, "router")["spec"]["template"]["spec"]["containers"][0]
    assert RDMA not in router.get("resources", {}).get("limits", {})
    for pool in POOLS:
        c = _container(_workload(objs, pool), pool)
        res, caps = c.get("resources", {}), c["securityContext"]["capabilities"]
        assert (res.get("requests", {}).get(RDMA), res.get("limits", {}).get(RDMA)) == (
            ("1", "1") if rdma else (None, None)
        )
        assert caps["drop"] == ["ALL"] and caps.get("add", []) == (["IPC_LOCK"] if rdma else [])
        assert not _parse(parser, objs, c).allow_tcp_staging

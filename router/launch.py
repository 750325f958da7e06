"""`pdserve up`: a router and node pools as local child processes, each in its own process group
and dying with `up` (PR_SET_PDEATHSIG, which the child sets: router/child_env.py); ready once
every node registered; `stop()` drains, then kills what is left. Secrets travel in the
environment, never on a command line."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from decode_node.config import DecodeNodeConfig
from encode_node.config import EncodeNodeConfig
from engine.options import options, to_argv
from prefill_node.config import PrefillNodeConfig
from router.child_env import launch_env
from router.config import RouterConfig
from router.console import say
from router.cpu_binding import (
    CpuBinding,
    NodeSlot,
    bound_env,
    decode_nice,
    decode_yield_ms,
    split_cpus,
    usable_cpus,
)
from router.node_forks import ForkedNode, Launcher
from serving.hosts import WILDCARDS, advertised_host
from serving.security import API_KEY_ENV, TOKEN_ENV, Credentials, Tls

ROOT = Path(__file__).resolve().parents[1]


NODE_CONFIGS = {"prefill": PrefillNodeConfig, "decode": DecodeNodeConfig, "encode": EncodeNodeConfig}
# set by `up` itself for every process it starts (the cluster token through the environment)
SECURITY_MANAGED = ("cluster_token_file", "insecure_open_cluster")
ROUTER_MANAGED = ("model", "host", "static_decode", "static_prefill", *SECURITY_MANAGED)
NODE_MANAGED = (
    "model",
    "tensor_parallel_size",
    "node_id",
    "router",
    "advertise_host",
    "metrics_port",
    *SECURITY_MANAGED,
)


@dataclass
class PoolSpec:
    """What `up` launches (from the command line or a pools file). Options are config fields
    (router.config.RouterConfig, the node configs) -> values; what is left out keeps its default.
    `node_options` go to every node whose config has the field; `prefill_options`,
    `decode_options` and `encode_options` to one pool, over `node_options`. `encode` nodes run
    only the vision encoder (docs/images.md, "The encode pool"); 0: none."""

    model: str
    prefill: int = 1
    decode: int = 1
    encode: int = 0
    prefill_tp: int = 1
    decode_tp: int = 1
    host: str = "127.0.0.1"
    # what the nodes advertise and `up` prints (transfer/netif.py advertised_host); None: host, or the
    # machine's primary address when host is a wildcard
    advertise_host: str | None = None
    port: int = 50051
    log_level: str = "INFO"
    drain_timeout_s: float = 30.0  # every component's --drain-timeout
    # the node plane's secret, handed to every process in PDSERVE_CLUSTER_TOKEN (never on a command
    # line); None: PDSERVE_CLUSTER_TOKEN of `up` itself, else a new random one per cluster
    cluster_token: str | None = field(default=None, repr=False)
    # no cluster token at all: every component starts with --insecure-open-cluster
    insecure_open_cluster: bool = False
    # the nodes' CPUs on this host (router/cpu_binding.py): auto, a share each; none, all of them each
    cpu_binding: CpuBinding = "none"
    # decode nodes' nice value (router/cpu_binding.py decode_nice); None: SHARED_DECODE_NICE where they share CPUs
    # with prefill nodes on the CPU, else 0
    decode_nice: int | None = None
    # fork: nodes forked from one launcher process (router/node_forks.py); spawn: each exec'd on its own
    node_start: str = "fork"
    # the router's; with metrics_port set, every node serves /metrics on a free port
    router_options: dict[str, Any] = field(default_factory=dict)
    node_options: dict[str, Any] = field(default_factory=dict)
    prefill_options: dict[str, Any] = field(default_factory=dict)
    decode_options: dict[str, Any] = field(default_factory=dict)
    encode_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.decode < 1:
            raise ValueError(f"need at least one decode node (got --decode {self.decode})")
        if self.prefill < 0:
            raise ValueError(f"--prefill must be >= 0 (got {self.prefill})")
        if self.encode < 0:
            raise ValueError(f"--encode must be >= 0 (got {self.encode})")
        split_cpus([], [], self.cpu_binding)  # a bad mode refused before anything starts
        self.decode_nice_value()  # a bad value too
        self.decode_yield_value()
        if not self.drain_timeout_s >= 0:  # NaN too
            raise ValueError(f"--drain-timeout must be >= 0 (got {self.drain_timeout_s})")
        if self.advertise_host is not None and self.advertise_host in WILDCARDS:
            raise ValueError(f"--advertise-host {self.advertise_host!r} is no address a peer can dial")
        if self.node_start not in ("fork", "spawn"):
            raise ValueError(f"--node-start must be fork or spawn (got {self.node_start!r})")
        if self.insecure_open_cluster and self.cluster_token:
            raise ValueError("--insecure-open-cluster and --cluster-token-file exclude each other")
        _check_keys("router", self.router_options, settable(RouterConfig, ROUTER_MANAGED))
        _check_keys("node", self.node_options, node_settable())
        for pool, cls in NODE_CONFIGS.items():
            _check_keys(f"{pool} pool", getattr(self, f"{pool}_options"), settable(cls, NODE_MANAGED))

    def pool_options(self, pool: str) -> dict[str, Any]:
        """The options of one pool's nodes: node_options its config has, then the pool's own."""
        names = _names(NODE_CONFIGS[pool])
        return {k: v for k, v in self.node_options.items() if k in names} | getattr(self, f"{pool}_options")

    def decode_nice_value(self) -> int:
        device = self.pool_options("decode").get("device", "cpu")
        return decode_nice(self.decode_nice, self.cpu_binding, self.prefill, device)

    def decode_yield_value(self) -> float:
        """The decode nodes' --yield-to-prefill-ms (router/cpu_binding.py decode_yield_ms)."""
        o = self.pool_options("decode")
        return decode_yield_ms(o.get("yield_to_prefill_ms"), self.cpu_binding, self.prefill, o.get("device", "cpu"))

    def router_argv(self) -> list[str]:
        """The router's flags; client API keys go through its environment instead (router_env)."""
        return to_argv(options(RouterConfig), {k: v for k, v in self.router_options.items() if k != "api_key"})

    def router_env(self) -> dict[str, str]:
        keys = [*self.router_options.get("api_key", ()), *filter(None, os.environ.get(API_KEY_ENV, "").split(","))]
        return {API_KEY_ENV: ",".join(keys)} if keys else {}

    def credentials(self, token: str) -> Credentials:
        """What `up` itself dials the router with (ListNodes while it waits for the nodes)."""
        o = self.router_options
        tls = Tls.from_files(o.get("tls_cert"), o.get("tls_key"), o.get("tls_ca"), o.get("tls_server_name"))
        return Credentials(cluster_token=token.encode() or None, tls=tls)

    def node_argv(self, pool: str) -> list[str]:
        """The options every node of `pool` is started with (beyond model, router, id, tp)."""
        extra: dict[str, Any] = {} if self.router_options.get("metrics_port") is None else {"metrics_port": 0}
        if pool == "decode":
            extra["yield_to_prefill_ms"] = self.decode_yield_value()
        return to_argv(options(NODE_CONFIGS[pool]), {**self.pool_options(pool), **extra})


def _names(cls) -> set[str]:
    return {o.name for o in options(cls)}


def settable(cls, managed: tuple[str, ...]) -> list[str]:
    """The options of `cls` that `up` passes on (the rest it sets itself)."""
    return [o.name for o in options(cls) if o.name not in managed]


def node_settable() -> list[str]:
    """Options of either node kind that `up` passes on, decode's first."""
    return list(dict.fromkeys(n for cls in (DecodeNodeConfig, PrefillNodeConfig) for n in settable(cls, NODE_MANAGED)))


def _check_keys(what: str, opts: dict, known: list[str]) -> None:
    bad = sorted(set(opts) - set(known))
    if bad:
        raise ValueError(f"unknown {what} option(s) {', '.join(bad)}; known: {', '.join(known)}")


TMP_PREFIX = "pdserve-up-"  # then the pid of the `up` that made it: a dead one's is swept


def sweep_stale_dirs(root: str | None = None) -> list[str]:
    """Remove the temporary directories (and cluster tokens in them) of `pdserve up` processes
    that are gone without cleaning up (SIGKILL); the ones removed."""
    root = root or tempfile.gettempdir()
    gone = []
    for name in os.listdir(root):
        pid = name.removeprefix(TMP_PREFIX).split("-", 1)[0]
        path = os.path.join(root, name)
        if not name.startswith(TMP_PREFIX) or not pid.isdigit() or os.stat(path).st_uid != os.getuid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path)
        except PermissionError:
            pass  # alive, another user's
    return gone


class Cluster:
    def __init__(self, spec: PoolSpec, out=sys.stdout, should_stop=lambda: False):
        self.spec = spec
        self.should_stop = should_stop  # checked while waiting: a signal during start-up
        self.out = out
        self.procs: dict[str, subprocess.Popen | ForkedNode] = {}
        self.launcher: Launcher | None = None  # forks the nodes (node_start fork)
        self.port: int | None = None
        self._reported: set[str] = set()
        self.cpus: dict[str, tuple[int, ...]] = {}  # node name -> its CPUs (start() decides)
        self.nice = 0  # decode nodes' nice value (start() decides)
        sweep_stale_dirs()
        self._tmp = tempfile.TemporaryDirectory(prefix=f"{TMP_PREFIX}{os.getpid()}-")
        self._token = spec.cluster_token or os.environ.get(TOKEN_ENV, "").strip()
        self.token_file: str | None = None  # where a token made here is kept, for the operator's tools
        if not self._token and not spec.insecure_open_cluster:
            self._token = secrets.token_urlsafe(32)
            self.token_file = os.path.join(self._tmp.name, "cluster-token")
            fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self._token)
        if spec.insecure_open_cluster:
            self._token = ""
        self.credentials = spec.credentials(self._token)
        self.advertised = advertised_host(spec.host, spec.advertise_host)

    @property
    def address(self) -> str:
        """The router's address as the nodes and clients dial it (never a wildcard)."""
        return f"{self.advertised}:{self.port}"

    def node_ids(self) -> list[str]:
        s = self.spec
        return (
            [f"prefill-{i}" for i in range(s.prefill)]
            + [f"decode-{i}" for i in range(s.decode)]
            + [f"encode-{i}" for i in range(s.encode)]
        )

    def node_slots(self) -> list[NodeSlot]:
        s = self.spec
        tp = {"prefill": s.prefill_tp, "decode": s.decode_tp, "encode": 1}
        return [NodeSlot(name, name.split("-")[0], tp[name.split("-")[0]]) for name in self.node_ids()]

    def _env(self, extra_env: dict[str, str] | None = None, cpus: tuple[int, ...] = ()) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in (API_KEY_ENV, TOKEN_ENV)}  # client keys: the router's
        env.update({TOKEN_ENV: self._token} if self._token else {}, **(extra_env or {}), **bound_env(cpus))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        return env

    def _spawn(
        self,
        name: str,
        args: list[str],
        extra_env: dict[str, str] | None = None,
        cpus: tuple[int, ...] = (),
        nice: int = 0,
    ) -> None:
        env = self._env(extra_env, cpus)
        if self.spec.insecure_open_cluster:
            args = [*args, "--insecure-open-cluster"]
        log_level, drain = ["--log-level", self.spec.log_level], ["--drain-timeout", str(self.spec.drain_timeout_s)]
        argv = [*log_level, *args, *drain]
        env.update(launch_env(cpus, nice))  # applied by the child first thing (router/child_env.py)
        if self.launcher is not None and name != "router":
            self.procs[name] = self.launcher.spawn(name, argv, env)
        else:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "router.cli", *argv], env=env, start_new_session=True
            )

    def start(self, ready_timeout: float = 300.0) -> None:
        s = self.spec
        port_file = Path(self._tmp.name) / "router.port"
        if s.node_start == "fork":  # it imports the node code while the router starts
            kinds = [k for k in ("prefill", "decode", "encode") if getattr(s, k)]
            self.launcher = Launcher(self._env() | launch_env(), kinds)
        bind = ["--host", s.host, "--port", str(s.port), "--port-file", str(port_file)]
        self._spawn("router", ["router", *bind, "--model", s.model, *s.router_argv()], s.router_env())
        deadline = time.monotonic() + ready_timeout
        while not (port_file.is_file() and port_file.read_text().strip()):
            self._check_children(deadline)
            time.sleep(0.05)
        self.port = int(port_file.read_text())
        self.cpus = split_cpus(usable_cpus(), self.node_slots(), s.cpu_binding)
        if self.cpus:
            shown = " ".join(f"{n}={','.join(map(str, c))}" for n, c in self.cpus.items())
            say(f"  cpu binding: {shown}", self.out)
        self.nice = s.decode_nice_value()
        held = s.decode_yield_value()
        ways = [f"decode steps held up to {held:g} ms while a prompt for them computes"] if held else []
        ways += [f"decode nodes at nice {self.nice}"] if self.nice else []
        if ways:
            off = " ".join(f for f, on in (("--yield-to-prefill-ms 0", held), ("--decode-nice 0", self.nice)) if on)
            say(f"  {', '.join(ways)}: prefill first on shared CPUs ({off}: off)", self.out)
        for i in range(s.prefill):
            self._spawn_node("prefill", i, s.prefill_tp)
        for i in range(s.decode):
            self._spawn_node("decode", i, s.decode_tp)
        for i in range(s.encode):
            self._spawn_node("encode", i, 1)
        self._wait_registered(deadline)

    def _spawn_node(self, kind: str, i: int, tp: int) -> None:
        s = self.spec
        name = f"{kind}-{i}"
        where = ["--router", self.address, "--host", s.host, "--advertise-host", self.advertised]
        where += ["--port", "0", "--node-id", name]
        argv = [kind, "--model", s.model, *where, "--tp", str(tp), *s.node_argv(kind)]
        self._spawn(name, argv, cpus=self.cpus.get(name, ()), nice=self.nice if kind == "decode" else 0)

    def _check_children(self, deadline: float) -> None:
        if self.should_stop():
            raise KeyboardInterrupt
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with status {p.returncode} during start-up")
        if time.monotonic() > deadline:
            raise TimeoutError("the pools did not come up in time")

    def _wait_registered(self, deadline: float) -> None:
        import grpc

        from proto import pb, rpc
        from serving.rpc import channel

        want = set(self.node_ids())
        shown = -1
        with channel(self.address, self.credentials) as ch:
            stub = rpc.RegistryStub(ch)
            while True:
                self._check_children(deadline)
                try:
                    nodes = stub.ListNodes(pb.ListNodesRequest(), timeout=2).nodes
                except grpc.RpcError:
                    nodes = []
                up = sorted(n.node.node_id for n in nodes if n.alive and n.node.node_id in want)
                if len(up) != shown:
                    shown = len(up)
                    say(f"  nodes registered: {len(up)}/{len(want)} {' '.join(up)}", self.out)
                if len(up) == len(want):
                    return
                time.sleep(0.1)

    def poll_exited(self) -> list[tuple[str, int]]:
        """Children that exited since the last call (each reported once)."""
        out = []
        for name, p in self.procs.items():
            if (rc := p.poll()) is not None and name not in self._reported:
                self._reported.add(name)
                out.append((name, rc))
        return out

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM every component; SIGKILL what has not exited after its drain + 15 s."""
        if timeout is None:
            timeout = self.spec.drain_timeout_s + 15.0
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs.values():  # the group: workers a node left behind, or a stuck node
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if p.poll() is None:
                p.wait(timeout=5)
        if self.launcher is not None:
            self.launcher.close()
        self._tmp.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

"""What the router and both node kinds share in their configuration: how a server proves itself
to its peers (SecurityArgs) and how a node joins the router (NodeArgs, on top of EngineArgs)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from engine.config import EngineArgs, EngineConfig
from engine.options import option
from serving.hosts import WILDCARDS


@dataclass(frozen=True)
class SecurityArgs:
    """How a server proves itself to its peers and checks them (router and both node kinds;
    serving/security.py). The secrets themselves are read from files or the environment, never
    kept in a config."""

    cluster_token_file: str | None = option(
        None, "file holding the cluster token, the node plane's shared secret (or PDSERVE_CLUSTER_TOKEN)"
    )
    insecure_open_cluster: bool = option(
        False, "start without a cluster token: any process that reaches this server can join the cluster"
    )
    tls_cert: str | None = option(None, "PEM certificate: serve gRPC (and HTTP) over TLS, shown to peers")
    tls_key: str | None = option(None, "PEM private key of --tls-cert")
    tls_ca: str | None = option(
        None, "PEM CA bundle peers' certificates are checked against; nodes then require the router's (mutual TLS)"
    )
    tls_server_name: str | None = option(
        None, "the name peers' certificates are checked against (default: the host dialed)"
    )

    def check_security(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.insecure_open_cluster and self.cluster_token_file:
            raise ValueError("--insecure-open-cluster and --cluster-token-file exclude each other")


@dataclass(frozen=True)
class NodeArgs(SecurityArgs, EngineArgs):
    """EngineArgs plus how a serving node joins the router: what both node configs
    (decode_node/config.py, prefill_node/config.py) share and serving/node.py reads."""

    node_id: str = option("node-0", "unique among the router's nodes")
    router: str | None = option(
        None,
        "router HOST:PORT to register with; several, comma-separated, for more than one router (each can "
        "then route here); none: standalone",
    )
    advertise_host: str = option(
        "127.0.0.1",
        "the host part of the address the router and peers dial (on the command line, default --host, or this "
        "machine's primary address when --host is a wildcard such as 0.0.0.0)",
    )
    heartbeat_interval_s: float = option(0.5, "seconds between heartbeats until the router names its own")
    transfer_backend: Literal["nixl", "ucxx"] = option("nixl", "data plane of the transfer endpoints")
    transfer_host: str | None = option(
        None,
        "address whose network interface the data plane (UCX) listens on (on the command line, default --host, "
        "or --advertise-host when --host is 0.0.0.0; 0.0.0.0: every interface)",
    )
    allow_tcp_staging: bool = option(
        False,
        "let GPU pools on machines without RDMA on both sides move over TCP, staged through host memory "
        "(refused at the transfer handshake otherwise; docs/transfer.md)",
    )
    metrics_port: int | None = option(None, "Prometheus /metrics on this port (0 picks one; default off)")
    served_model_name: tuple[str, ...] = option(
        (),
        "the router's --served-model-name: the first is the model_name label of this node's vllm:* series, as "
        "the router's (repeatable; default: the checkpoint directory's name, ORG/NAME for a Hugging Face cache "
        "snapshot)",
    )
    worker_process: bool = option(
        False,
        "run the model in a process of its own also at --tp 1, as each rank runs at --tp > 1: the node's gRPC "
        "threads then never wait for the GIL behind the model's Python, but every step and transfer poll is a "
        "round trip to the rank (docs/benchmarks.md, served against offline)",
    )

    def engine_config(self, check_only: bool = False) -> EngineConfig:
        cfg = super().engine_config(check_only)
        return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, worker_process=self.worker_process))

    @property
    def data_host(self) -> str:
        """The address whose interface the data plane uses (transfer/netif.py)."""
        return self.transfer_host or self.advertise_host

    def __post_init__(self) -> None:
        self.check_security()
        if self.advertise_host in WILDCARDS:
            raise ValueError(
                f"--advertise-host {self.advertise_host!r} is no address a peer can dial: give this machine's "
                "address (or leave it out: the primary address is advertised)"
            )
        # the router refuses an empty id at Register, and the node would only log that and retry
        if not self.node_id.strip() or self.node_id != self.node_id.strip():
            raise ValueError(f"--node-id {self.node_id!r}: give the node a name, with no space at either end")
        if self.heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s must be positive (got {self.heartbeat_interval_s})")

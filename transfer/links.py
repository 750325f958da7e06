"""What a pair of transfer endpoints moves its bytes over. Each rank publishes its `Host` at
handshake: the machine it runs on, where its pools live, the RDMA devices it can open and UCX_TLS.
`link` decides from the two what UCX can use between them, for the one INFO line each peer pair
logs; `check_link` refuses the pairing UCX would carry badly without saying so: pools on a GPU,
ranks on different machines and no RDMA device on both, where every byte would be staged
through host memory over TCP (`--allow-tcp-staging` lets it through). docs/transfer.md, "The
data plane on real hardware".

The decision is the one UCX makes from the same facts, not a query of its lanes (NIXL does not
expose them): endpoints run with peer error handling (UCXX's can turn it off), under which UCX
leaves out its shared-memory transports, so ranks on one machine move CPU pools over TCP on
loopback."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import msgspec

from transfer.errors import HandshakeError

IB_SYSFS = Path("/sys/class/infiniband")
IB_DEV = Path("/dev/infiniband")
MACHINE_ID = Path("/etc/machine-id")
# UCX_TLS aliases that name the RDMA transports (UCX's own names and groups)
RDMA_TLS = ("rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5", "dc", "dc_x", "dc_mlx5", "ud", "ud_v", "ud_x", "ib")


class Host(msgspec.Struct, frozen=True):
    """Where a rank's bytes live and what its UCX can reach them with."""

    machine: str = ""  # /etc/machine-id, else the host name ("": unknown, treated as another machine)
    memory: str = "cpu"  # "cpu" | "cuda": the device of the rank's pools
    rdma: tuple[str, ...] = ()  # RDMA devices this process can open (/dev/infiniband is mapped in)
    tls: str = ""  # UCX_TLS as the rank has it ("": UCX's default, every transport)
    shared_memory: bool = False  # its UCX runs without peer error handling (UCXX, turned off)


class Link(msgspec.Struct, frozen=True):
    transports: str  # what UCX can carry the pair's bytes over
    staged: bool  # GPU pools whose bytes pass through host memory over TCP


def machine_id() -> str:
    try:
        return MACHINE_ID.read_text().strip() or socket.gethostname()
    except OSError:
        return socket.gethostname()


def rdma_devices(sysfs: Path = IB_SYSFS, dev: Path = IB_DEV) -> tuple[str, ...]:
    """The RDMA devices of this machine, when this process can open them (their uverbs nodes are
    mapped into it, as the RDMA device plugin or a privileged pod does); () otherwise."""
    try:
        if not any(p.name.startswith("uverbs") for p in dev.iterdir()):
            return ()
        return tuple(sorted(p.name for p in sysfs.iterdir()))
    except OSError:
        return ()


def local_host(memory: str, shared_memory: bool = False) -> Host:
    cuda = memory.startswith("cuda")
    return Host(machine_id(), "cuda" if cuda else "cpu", rdma_devices(), os.environ.get("UCX_TLS", ""), shared_memory)


def tls_allows(tls: str, names: tuple[str, ...]) -> bool:
    """Whether UCX_TLS `tls` leaves any of `names` enabled ("", "all": everything; "^a,b": all
    but those; "a,b": only those)."""
    tls = tls.strip()
    if tls in ("", "all"):
        return True
    if tls.startswith("^"):
        off = {t.strip() for t in tls[1:].split(",")}
        return any(n not in off for n in names)
    on = {t.strip() for t in tls.split(",")}
    return "all" in on or any(n in on for n in names)


def link(local: Host, remote: Host) -> Link:
    """What the pair's bytes can move over, as UCX would choose from these facts."""
    gpu = "cuda" in (local.memory, remote.memory)
    if local.machine and local.machine == remote.machine:
        if gpu and tls_allows(local.tls, ("cuda_ipc", "cuda")) and tls_allows(remote.tls, ("cuda_ipc", "cuda")):
            return Link("cuda_ipc (GPU to GPU on one machine)", False)
        if not gpu and local.shared_memory and remote.shared_memory:
            return Link("shared memory (one machine)", False)
        return Link("tcp on loopback (one machine; peer error handling leaves shared memory out)", gpu)
    rdma = local.rdma and remote.rdma and tls_allows(local.tls, RDMA_TLS) and tls_allows(remote.tls, RDMA_TLS)
    if rdma:
        devs = f"{','.join(local.rdma)} -> {','.join(remote.rdma)}"
        return Link(f"RDMA ({devs}{', GPUDirect' if gpu else ''})", False)
    if local.rdma and remote.rdma:
        why = "UCX_TLS leaves RDMA out"
    else:
        side = "the peer" if local.rdma else "this side" if remote.rdma else "either side"
        why = f"no RDMA device on {side}"
    return Link(f"tcp between machines ({why})", gpu)


def check_link(local: Host, remote: Host, allow_staging: bool) -> Link:
    """The pair's link; HandshakeError where GPU memory would be staged through the host over TCP
    and that is not allowed."""
    ln = link(local, remote)
    if ln.staged and not allow_staging:
        raise HandshakeError(
            "data plane",
            local,
            remote,
            f"GPU pools would move over {ln.transports}, staged through host memory: give both nodes an "
            "RDMA device (docs/transfer.md, 'The data plane on real hardware') or start them with "
            "--allow-tcp-staging",
        )
    return ln

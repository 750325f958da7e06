"""transfer/links.py: what a pair of endpoints moves its bytes over, decided from what each rank
publishes (machine, pools' memory, RDMA devices, UCX_TLS), against the cases written out by hand;
and on two real endpoints: the INFO line each pair logs, and the refusal of GPU pools staged
through host memory over TCP unless --allow-tcp-staging."""

from __future__ import annotations

import logging

import msgspec
import pytest

from tests.helpers.xfer_state import engine_cfg, make_pools, tiny_model
from transfer import HandshakeError, Receiver, Sender, TransferConfig
from transfer.links import Host, check_link, link, local_host, rdma_devices, tls_allows
from transfer.schema import decode_peer, encode

pytestmark = pytest.mark.timeout(120)

A, B = "machine-a", "machine-b"


def test_ucx_tls_semantics():
    assert tls_allows("", ("rc",)) and tls_allows("all", ("rc",))
    assert tls_allows("rc,cuda_copy", ("rc", "ud")) and not tls_allows("tcp,cuda_copy", ("rc", "ud"))
    assert not tls_allows("^rc,ud", ("rc", "ud")) and tls_allows("^tcp", ("rc",))


@pytest.mark.parametrize(
    ("local", "remote", "says", "staged"),
    [
        (Host(A), Host(A), "tcp on loopback", False),  # one machine, CPU pools
        (Host(A, shared_memory=True), Host(A, shared_memory=True), "shared memory", False),  # UCXX, no peer errors
        (Host(A, shared_memory=True), Host(A), "tcp on loopback", False),
        (Host(A, "cuda"), Host(A, "cuda"), "cuda_ipc", False),
        (Host(A, "cuda", tls="tcp"), Host(A, "cuda"), "tcp on loopback", True),
        (Host(A), Host(B), "tcp between machines (no RDMA device on either side)", False),  # host memory anyway
        (Host(A, "cuda"), Host(B, "cuda"), "tcp between machines (no RDMA device on either side)", True),
        (Host(A, "cuda", ("mlx5_0",)), Host(B, "cuda"), "no RDMA device on the peer", True),
        (Host(A, "cuda", ("mlx5_0",)), Host(B, "cuda", ("mlx5_1",)), "RDMA (mlx5_0 -> mlx5_1, GPUDirect)", False),
        (Host(A, "cuda", ("mlx5_0",), "tcp,cuda_copy"), Host(B, "cuda", ("mlx5_1",)), "UCX_TLS leaves RDMA out", True),
        (Host("", "cuda"), Host("", "cuda"), "between machines", True),  # unknown machines: not the same one
    ],
)
def test_link_from_both_sides_facts(local, remote, says, staged):
    ln = link(local, remote)
    assert says in ln.transports and ln.staged is staged
    if staged:
        with pytest.raises(HandshakeError, match="--allow-tcp-staging"):
            check_link(local, remote, allow_staging=False)
    assert check_link(local, remote, allow_staging=True) == ln


def test_rdma_devices_need_their_uverbs_nodes(tmp_path):
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    (sysfs / "mlx5_1").mkdir(parents=True)
    (sysfs / "mlx5_0").mkdir()
    assert rdma_devices(sysfs, dev) == ()  # the machine has them, this process cannot open them
    dev.mkdir()
    (dev / "rdma_cm").touch()
    assert rdma_devices(sysfs, dev) == ()
    (dev / "uverbs0").touch()
    assert rdma_devices(sysfs, dev) == ("mlx5_0", "mlx5_1")
    h = local_host("cuda:1")
    assert h.memory == "cuda" and h.machine and local_host("cpu").memory == "cpu"


def _endpoints(cfg: TransferConfig | None = None):
    model = tiny_model()
    ec = engine_cfg(model, 1)
    return Sender(ec, 0, make_pools(ec, 0), "P", cfg), Receiver(ec, 0, make_pools(ec, 0), "D", cfg)


def test_a_real_pair_logs_its_link(caplog):
    tx, rx = _endpoints()
    try:
        with caplog.at_level(logging.INFO, logger="transfer.endpoint"):
            tx.add_peer(rx.metadata())
        line = [r.getMessage() for r in caplog.records if r.name == "transfer.endpoint" and rx.agent in r.getMessage()]
        assert line == [f"transfer {tx.agent} -> {rx.agent}: UCX over {link(tx.info.host, rx.info.host).transports}"]
        assert "tcp on loopback" in line[0]  # both on this machine, CPU pools
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("allow", [False, True])
def test_gpu_pools_across_machines_without_rdma_are_refused_unless_allowed(allow):
    tx, rx = _endpoints(TransferConfig(allow_tcp_staging=allow))
    try:
        info = decode_peer(rx.metadata())  # the receiver as a GPU rank on another machine would publish it
        far = msgspec.structs.replace(info, host=Host("another-machine", "cuda"))
        if allow:
            assert tx.add_peer(encode(far)) == rx.agent
        else:
            with pytest.raises(HandshakeError, match="staged through host memory.*--allow-tcp-staging"):
                tx.add_peer(encode(far))
            assert not tx.peers
    finally:
        tx.close()
        rx.close()

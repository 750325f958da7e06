"""The data plane binds where the node binds: in `pdserve up` on 127.0.0.1 (one prefill + one
decode node, disaggregated) every socket each node process listens on, its UCX transfer
endpoint's included, is on 127.0.0.1, and a request still goes through the transfer; a node told
`--transfer-host 0.0.0.0` listens on the machine's other interfaces too (what the check would
catch). Sockets are read from /proc: the process's socket inodes against /proc/net/tcp{,6}."""

from __future__ import annotations

import ipaddress
import os

import pytest

from tests.helpers.serve_harness import Proc, Up, flags, node_pid
from transfer.netif import addresses


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for name in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{name}") as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                hexip, hexport = cols[1].split(":")
                raw = bytes.fromhex(hexip)
                # /proc prints the address as 32-bit words in host order
                ip = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                addr = ipaddress.ip_address(ip)
                if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
                    addr = addr.ipv4_mapped  # UCX listens on ::ffff:a.b.c.d for an IPv4 interface
                out.append((str(addr), int(hexport, 16)))
    return out


@pytest.fixture(scope="module")
def up(ckpt):
    u = Up("--model", ckpt, "--dtype", "float32", "--decode", "1", "--prefill", "1")
    yield u
    assert u.stop() == 0, u.output()


def test_every_listening_socket_of_each_node_is_on_its_host(up):
    from client import Client

    with Client(up.address, timeout=120) as c:
        c.wait_ready(timeout=60)
        r = c.generate(prompt_token_ids=list(range(1, 40)), max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(r.token_ids) == 4 and r.prefill_node == "prefill-0", r  # through the transfer
    for node in ("prefill-0", "decode-0"):
        socks = listening(node_pid(up, node))
        # gRPC, and UCX's own listeners (one per transfer endpoint at least)
        assert len(socks) >= 2, (node, socks)
        assert {a for a, _ in socks} == {"127.0.0.1"}, (node, socks)


def test_a_wildcard_transfer_host_listens_everywhere(ckpt):
    others = [ip for _, ip, loop in addresses() if not loop and isinstance(ip, ipaddress.IPv4Address)]
    if not others:
        pytest.skip("this machine has no network interface but loopback")
    opts = flags(dtype="float32", transfer_host="0.0.0.0")
    p = Proc("decode", "--model", ckpt, *opts, ready=r"decode node \S+ listening on (\S+)")
    try:
        addrs = {a for a, _ in listening(p.proc.pid)}
        assert addrs & {str(ip) for ip in others}, addrs
    finally:
        assert p.stop() == 0, p.output()

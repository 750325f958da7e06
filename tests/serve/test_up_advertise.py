"""A node bound to a wildcard (`--host 0.0.0.0`) advertises an address a peer can dial: it
registered as 0.0.0.0:PORT, which the router dialled only because it ran on the same machine, a
remote router or peer could not, and every log line named 0.0.0.0. Now it advertises
--advertise-host, else this machine's primary address; `up` passes --advertise-host on and prints
the router's address the same way."""

from __future__ import annotations

import ipaddress
import socket

import pytest

from decode_node.config import DecodeNodeConfig
from router.cli import _node_config, build_parser
from tests.helpers.serve_harness import Up, nodes
from transfer.netif import addresses


def _config(*argv: str) -> DecodeNodeConfig:
    return _node_config(DecodeNodeConfig, build_parser().parse_args(["decode", "--model", "m", *argv]))


def _dialable_here(host: str) -> bool:
    """An address of this machine (a socket binds it) that is no wildcard; off the loopback when
    the machine has an IPv4 address off it."""
    ip = ipaddress.ip_address(host)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
    off_loopback = any(a.version == 4 and not loop for _, a, loop in addresses())
    return not ip.is_unspecified and (ip.is_loopback is not off_loopback)


def test_a_wildcard_bind_advertises_this_machines_address():
    cfg = _config("--host", "0.0.0.0")
    assert _dialable_here(cfg.advertise_host), cfg.advertise_host
    assert cfg.data_host == cfg.advertise_host  # the data plane on that address's interface
    assert _config("--host", "0.0.0.0", "--advertise-host", "node-7.pods").advertise_host == "node-7.pods"
    assert _config("--host", "127.0.0.1").advertise_host == "127.0.0.1"
    with pytest.raises(ValueError, match="no address a peer can dial"):
        _config("--host", "0.0.0.0", "--advertise-host", "0.0.0.0")


def test_up_refuses_a_wildcard_to_advertise(capsys):
    """Refused before anything starts (the router started, then each node refused it)."""
    from router.cli import main

    assert main(["up", "--advertise-host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["pdserve up: error: --advertise-host '0.0.0.0' is no address a peer can dial"], err


def test_up_on_a_wildcard_registers_dialable_nodes(ckpt):
    from client import Client

    up = Up("--model", ckpt, "--dtype", "float32", "--host", "0.0.0.0")
    try:
        host, _ = up.address.rsplit(":", 1)
        assert _dialable_here(host), up.address
        got = {n.node.node_id: n.node.address for n in nodes(up.address)}
        assert set(got) == {"prefill-0", "decode-0"}
        assert all(a.rsplit(":", 1)[0] == host for a in got.values()), got
        with Client(up.address, timeout=60) as c:
            r = c.generate(prompt_token_ids=[1, 2, 3], max_tokens=3, temperature=0.0, ignore_eos=True)
        assert len(r.token_ids) == 3 and r.prefill_node == "prefill-0"
        assert "0.0.0.0" not in "".join(ln for ln in up.lines if "registered" in ln), up.output()
    finally:
        assert up.stop() == 0, up.output()

"""`pdserve up` takes every option of every component it starts: each is one of up's flags or one
that up sets itself (a node's id, router and address, the router's node lists); and
`up --insecure-open-cluster` starts a cluster with no cluster token at all, which serves and
whose node plane answers a caller that holds no token."""

from __future__ import annotations

import argparse

import pytest

from decode_node.config import DecodeNodeConfig
from encode_node.config import EncodeNodeConfig
from engine.options import options
from prefill_node.config import PrefillNodeConfig
from router.cli import _up_spec, build_parser
from router.config import RouterConfig
from tests.helpers.serve_harness import Up, flags, nodes

# what `up` decides for each process it starts, from its own flags (--host, --prefill-tp, ...)
SET_BY_UP = {"static_decode", "static_prefill", "node_id", "router", "advertise_host", "tensor_parallel_size"}


def _up_flags() -> set[str]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return {s for a in sub.choices["up"]._actions for s in a.option_strings}


def test_up_has_a_flag_for_every_component_option():
    flags = _up_flags()
    for cls in (RouterConfig, DecodeNodeConfig, PrefillNodeConfig, EncodeNodeConfig):
        for o in options(cls):
            assert o.flag in flags or o.name in SET_BY_UP, f"{cls.__name__}.{o.name} ({o.flag}) cannot be set by up"
    assert {"--prefill-tp", "--decode-tp", "--encode", "--host", "--model"} <= flags


def test_insecure_open_cluster_is_up_s_own_flag(tmp_path):
    spec = _up_spec(build_parser().parse_args(["up", "--insecure-open-cluster", "--prefill", "0"]))
    assert spec.insecure_open_cluster and "insecure_open_cluster" not in spec.router_options
    assert not _up_spec(build_parser().parse_args(["up"])).insecure_open_cluster
    tok = tmp_path / "token"
    tok.write_text("a-token-of-some-length-1234567890")
    ns = build_parser().parse_args(["up", "--insecure-open-cluster", "--cluster-token-file", str(tok)])
    with pytest.raises(ValueError, match="exclude each other"):
        _up_spec(ns)


def test_an_open_cluster_serves_without_any_token(ckpt):
    opts = flags(dtype="float32", decode=1, prefill=1)
    up = Up("--model", ckpt, *opts, "--insecure-open-cluster", env={"PDSERVE_CLUSTER_TOKEN": ""})
    try:
        from client import Client

        with Client(up.address, timeout=120) as c:
            c.wait_ready(timeout=60)
            r = c.generate(prompt_token_ids=[1, 2, 3, 4], max_tokens=3, temperature=0.0, ignore_eos=True)
        assert len(r.token_ids) == 3 and r.prefill_node == "prefill-0"
        assert sorted(n.node.node_id for n in nodes(up.address, c=_open())) == ["decode-0", "prefill-0"]
        assert "--insecure-open-cluster" in up.output()
    finally:
        assert up.stop() == 0, up.output()


def _open():
    from serving.security import OPEN

    return OPEN

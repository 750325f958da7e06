"""Options declared once (engine/options.py): the flags of `router`, `decode`, `prefill` and `up`
are generated from the config dataclasses, `up` passes every node option on, and the pools
file's per-pool keys reach only that pool: in the command lines `up` builds, and as the started
nodes report themselves (capacity, max_model_len) to the router."""

from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest

from decode_node.config import DecodeNodeConfig
from engine.config import EngineArgs
from engine.options import options
from prefill_node.config import PrefillNodeConfig
from router.cli import _up_spec, build_parser, main
from router.config import RouterConfig
from router.launch import NODE_MANAGED, ROUTER_MANAGED, PoolSpec
from router.policy import POLICIES, PolicyName
from tests.helpers.serve_harness import Up, nodes

CONFIGS = {"router": RouterConfig, "decode": DecodeNodeConfig, "prefill": PrefillNodeConfig}


def _sub(cmd: str) -> argparse.ArgumentParser:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[cmd]


def _flags(cmd: str) -> dict[str, argparse.Action]:
    return {s: a for a in _sub(cmd)._actions for s in a.option_strings}


@pytest.mark.parametrize("cmd", list(CONFIGS))
def test_every_field_is_a_documented_flag(cmd):
    cls = CONFIGS[cmd]
    opts = options(cls)
    assert [o.name for o in opts] == [f.name for f in dataclasses.fields(cls)], "a field declared without option()"
    flags = _flags(cmd)
    for o in opts:
        assert o.help and o.flag in flags, o.name
        assert flags[o.flag].choices == o.choices
        if o.flag != "--advertise-host":
            assert _sub(cmd).get_default(o.dest) == (None if o.repeat else o.default), o.name


def test_choices_come_from_literal_fields():
    hints = typing.get_type_hints(EngineArgs)
    assert _flags("decode")["--speculative-method"].choices == typing.get_args(hints["speculative_method"])
    assert _flags("up")["--dtype"].choices == typing.get_args(hints["dtype"])
    assert set(typing.get_args(PolicyName)) == set(POLICIES)
    assert _flags("router")["--policy"].choices == typing.get_args(PolicyName)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["prefill", "--speculative-method", "medusa"])


def test_the_old_flags_and_defaults_still_parse():
    argv = "decode --tp 2 --kv-cache-memory 1GiB --local-prefill-threshold 8 --advertise-host 10.0.0.1 --node-id d-1"
    ns = build_parser().parse_args(argv.split())
    assert (ns.tp, ns.kv_cache_memory, ns.local_prefill_threshold, ns.port, ns.host) == (2, "1GiB", 8, 0, "127.0.0.1")
    from router.cli import _node_config

    cfg = _node_config(DecodeNodeConfig, build_parser().parse_args(["decode", "--model", "m", "--host", "10.0.0.1"]))
    assert cfg == DecodeNodeConfig(model="m", advertise_host="10.0.0.1")  # every other field at its default
    ns = build_parser().parse_args(
        ["router", "--decode", "a:1", "--decode", "b:2", "--admission-timeout", "3", "--reservation-lease", "9"]
    )
    assert ns.decode == ["a:1", "b:2"] and ns.admission_timeout == 3.0 and ns.port == 50051


def test_up_has_every_node_and_router_option():
    flags = _flags("up")
    for cmd, cls in CONFIGS.items():
        managed = ROUTER_MANAGED if cmd == "router" else NODE_MANAGED
        missing = [o.flag for o in options(cls) if o.name not in managed and o.flag not in flags]
        assert not missing, f"`up` lacks {cmd} options {missing}"
    for flag in ("--max-model-len", "--block-size", "--seed", "--push-timeout", "--prefill-timeout"):
        assert flags[flag].default is None  # unset unless given: the file can fill it


def _spec(ckpt, tmp_path, text: str, *argv: str) -> PoolSpec:
    cfg = tmp_path / "pools.yaml"
    cfg.write_text(f"model: {ckpt}\nport: 0\n" + text)
    return _up_spec(build_parser().parse_args(["up", "--config", str(cfg), *argv]))


def test_pools_file_per_pool_keys_and_precedence(ckpt, tmp_path):
    text = (
        "block_size: 32\nmax_num_seqs: 16\nmax-model-len: 500\npolicy: round-robin\n"
        "prefill: {count: 2, tp: 2, max_num_seqs: 5, push_timeout: 9}\n"
        "decode: {count: 1, max_num_seqs: 3, local_prefill_threshold: 7, default_reservation_lease: 4}\n"
    )
    spec = _spec(ckpt, tmp_path, text, "--max-model-len", "300", "--dtype", "float32")
    assert (spec.prefill, spec.prefill_tp, spec.decode, spec.decode_tp, spec.port) == (2, 2, 1, 1, 0)
    both = {"block_size": 32, "max_model_len": 300, "dtype": "float32"}  # the command line wins over the file
    assert spec.prefill_options == {**both, "max_num_seqs": 5, "push_timeout_s": 9.0}
    assert spec.decode_options == {**both, "max_num_seqs": 3, "local_prefill_threshold": 7, "reservation_lease_s": 4.0}
    assert spec.router_options == {"policy": "round-robin"}
    pre, dec = spec.node_argv("prefill"), spec.node_argv("decode")
    assert pre[pre.index("--max-num-seqs") + 1] == "5" and dec[dec.index("--max-num-seqs") + 1] == "3"
    assert "--local-prefill-threshold" not in pre and "--push-timeout" not in dec
    for argv in (pre, dec):
        assert argv[argv.index("--max-model-len") + 1] == "300" and argv[argv.index("--block-size") + 1] == "32"
        ns = build_parser().parse_args(["prefill" if argv is pre else "decode", *argv])  # the node reads them back
        assert ns.max_model_len == 300 and ns.block_size == 32
    assert spec.router_argv() == ["--policy", "round-robin"]
    # the command line wins over a pool's key too
    spec = _spec(ckpt, tmp_path, "decode: {max_num_seqs: 3}\n", "--max-num-seqs", "4")
    assert spec.decode_options["max_num_seqs"] == spec.prefill_options["max_num_seqs"] == 4


@pytest.mark.parametrize(
    ("text", "bad", "known"),
    [
        ("bogus: 1\nmax_num_seq: 2\n", "bogus, max_num_seq", "max_num_seqs"),
        ("prefill: {count: 1, local_prefill_threshold: 4}\n", "under prefill: local_prefill_threshold", "push_timeout"),
        ("decode: {push_timeout: 4}\n", "under decode: push_timeout", "local_prefill_threshold"),
        ("decode: {policy: round-robin}\n", "under decode: policy", "max_num_seqs"),
    ],
)
def test_unknown_keys_are_refused_in_one_line(ckpt, tmp_path, capsys, text, bad, known):
    cfg = tmp_path / "pools.yaml"
    cfg.write_text(f"model: {ckpt}\n" + text)
    assert main(["up", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"unknown key(s) {bad}; known: " in err and known in err.split("known: ")[1]


def test_bad_values_are_refused_before_anything_starts(ckpt, tmp_path):
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        _spec(ckpt, tmp_path, "decode: {block_size: 24}\n")
    with pytest.raises(ValueError, match="speculative_method: 'medusa' is not one of ngram, mtp"):
        _spec(ckpt, tmp_path, "speculative_method: medusa\n")
    with pytest.raises(ValueError, match="unknown decode pool option"):
        PoolSpec(model="m", decode_options={"push_timeout_s": 1.0})
    with pytest.raises(ValueError, match="unknown node option"):
        PoolSpec(model="m", node_options={"node_id": "x"})  # up names its nodes itself


def test_up_per_pool_options_reach_only_that_pool(ckpt, tmp_path):
    cfg = tmp_path / "pools.yaml"
    cfg.write_text("block_size: 32\nprefill: {count: 1, max_num_seqs: 5}\ndecode: {count: 1, max_num_seqs: 3}\n")
    up = Up("--config", str(cfg), "--model", ckpt, "--dtype", "float32", "--max-model-len", "300")
    try:
        got = {n.node.node_id: n.node for n in nodes(up.address)}
        assert set(got) == {"prefill-0", "decode-0"}
        for node_id, slots in (("prefill-0", 5), ("decode-0", 3)):
            info = got[node_id]
            assert (info.capacity.total_slots, info.capacity.block_size, info.max_model_len) == (slots, 32, 300)
        from client import Client

        with Client(up.address, timeout=60) as c:
            r = c.generate(prompt_token_ids=[1, 2, 3], max_tokens=4, temperature=0.0, ignore_eos=True)
        assert len(r.token_ids) == 4 and r.prefill_node == "prefill-0"
    finally:
        rc = up.stop()
    assert rc == 0, up.output()


def test_encode_pool_options_reach_the_encode_nodes_only():
    """`--encode N` adds N encode nodes (0 by default); an encode option goes to them alone, an
    every-node option to them too; a checkpoint without a vision tower is refused before anything
    starts."""
    import dataclasses

    from router.cli import _up_spec, build_parser
    from router.launch import Cluster

    spec = _up_spec(build_parser().parse_args(["up", "--encode-push-timeout", "5", "--dtype", "float32"]))
    assert spec.encode == 0 and spec.encode_options == {"dtype": "float32", "encode_push_timeout_s": 5.0}
    assert "encode_push_timeout_s" not in spec.prefill_options | spec.decode_options
    assert "--encode-push-timeout" in spec.node_argv("encode") and "--encode-push-timeout" not in spec.node_argv(
        "prefill"
    )
    with Cluster(dataclasses.replace(spec, encode=2)) as cl:  # nothing started: stop() only cleans up
        assert cl.node_ids()[-2:] == ["encode-0", "encode-1"]
    with pytest.raises(ValueError, match="--encode 1: .* has no vision tower"):
        _up_spec(build_parser().parse_args(["up", "--encode", "1"]))

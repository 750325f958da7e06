"""Qwen3.5-MoE and Qwen3-Next served disaggregated through `pdserve up`: the prefill and decode
pools at different TP sizes give transformers' greedy tokens. MoE blocks hold no per-request
state, so what crosses the pools is the same typed KV + GDN state as for the dense model; the
model digest in the schema names the architecture and the MoE sizes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import hybrid_ckpt as hc
import pytest
from serve_harness import Up, decode_stats, nodes, wait_for

NEW = 12
PAIRS = [(2, 1), (1, 2), (4, 2)]


@pytest.fixture(scope="module")
def moe_served(tmp_path_factory):
    """arch -> (checkpoint, prompts, transformers' greedy tokens for each prompt)."""
    made = {}

    def get(arch):
        if arch not in made:
            path = hc.make(tmp_path_factory.mktemp(f"serve-{arch}") / "ckpt", hc.SPEC_MOE[arch])
            ps = hc.prompts(hc.SPEC_MOE[arch].vocab, (1, 9, 40), seed=7)
            made[arch] = path, ps, [hc.hf_greedy(path, p, NEW) for p in ps]
        return made[arch]

    return get


def _node(address, node_id):
    return next(n.node for n in nodes(address) if n.node.node_id == node_id)


@pytest.mark.parametrize("arch", list(hc.SPEC_MOE))
@pytest.mark.parametrize("a,b", PAIRS, ids=[f"tp{a}to{b}" for a, b in PAIRS])
def test_moe_greedy_matches_transformers_across_tp(moe_served, arch, a, b):
    from client import Client

    path, ps, want = moe_served(arch)
    up = Up("--model", path, "--dtype", "float32", "--prefill", "1", "--decode", "1", "--prefill-tp", str(a),
            "--decode-tp", str(b), "--local-prefill-threshold", "0")  # fmt: skip
    try:
        d = _node(up.address, "decode-0")
        assert d.tp_size == b and _node(up.address, "prefill-0").tp_size == a
        initial = decode_stats(d.address).capacity
        with Client(up.address, timeout=180) as c:
            c.wait_ready(timeout=90)
            jobs = [i % len(ps) for i in range(6)]
            with ThreadPoolExecutor(6) as ex:
                outs = list(ex.map(lambda i: c.generate(prompt_token_ids=ps[i], max_tokens=NEW, temperature=0.0,
                                                         ignore_eos=True), jobs))  # fmt: skip
        for i, r in zip(jobs, outs, strict=True):
            assert r.token_ids == want[i], f"{arch}: prompt of {len(ps[i])} tokens, tp {a} -> {b}"
            assert r.prefill_node == "prefill-0" and r.transfer_bytes > 0
        wait_for(lambda: decode_stats(d.address).capacity == initial, 30, "the decode node's memory back")
    finally:
        rc = up.stop()
    assert rc == 0, up.output()

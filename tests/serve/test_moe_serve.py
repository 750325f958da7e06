"""Qwen3.5-MoE and Qwen3-Next served disaggregated through `pdserve up`: the prefill and decode
pools at different TP sizes give transformers' greedy tokens. MoE blocks hold no per-request
state, so what crosses the pools is the same typed KV + GDN state as for the dense model; the
model digest in the schema names the architecture and the MoE sizes."""

from __future__ import annotations

import pytest

from tests.helpers import hybrid_ckpt as hc
from tests.helpers.serve_harness import check_disaggregated_greedy

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


# two of the six in the suite (each architecture once, both directions of resharding); the rest slow
SUITE = {("qwen3_5_moe", 2, 1), ("qwen3_next", 4, 2)}


@pytest.mark.parametrize(
    "arch,a,b",
    [
        pytest.param(arch, a, b, id=f"tp{a}to{b}-{arch}", marks=() if (arch, a, b) in SUITE else pytest.mark.slow)
        for arch in hc.SPEC_MOE
        for a, b in PAIRS
    ],
)
def test_moe_greedy_matches_transformers_across_tp(moe_served, arch, a, b):
    path, ps, want = moe_served(arch)
    check_disaggregated_greedy(path, ps, want, a, b, requests=6, what=f"{arch}: ")

"""The real engine on both sides of the recurrent-state cast: a prefill engine with a float32 GDN
recurrent state (--mamba-ssm-cache-dtype float32) hands a prompt to a decode engine with a
bfloat16 one, TP 1 -> 1 and 2 -> 1 over NIXL. The decode engine's slot holds the cast of the
prefill's state bit for bit, and its greedy tokens are an offline bfloat16-state engine's.

The reference: the offline engine with a bfloat16 state prefills each prompt in one chunk; its
GDN kernels widen the (zero) initial state, run the recurrence in float32 exactly as the float32
engine does, and round once when they store. So after its prefill it holds what the decode node
is given, the float32 prefill's state rounded once to bfloat16, with the same first token, KV
pages and conv state; from there both decode with a bfloat16 state. The float32 engine's own
tokens are not the reference: the decode node's steps start from the rounded state."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch

from engine import SamplingParams
from engine.core import EngineCore
from engine.llm import LLM
from tests.helpers import hybrid_ckpt as hc
from tests.transfer.test_transfer_engine import (
    PROMPT_LENS,
    _metadata,
    _until,
    decode_after,
    engine,
    read_state,
    reshard,
    to_global,
)
from transfer import TransferConfig
from transfer import rank as xr

SP = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
pytestmark = pytest.mark.timeout(300)


def _engine(path: str, tp: int, state: str) -> LLM:
    return engine(path, tp, mamba_ssm_cache_dtype=state)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Wide weights in float32 (tests/engine/test_ssm_dtype.py's): a bfloat16 state parts from a
    float32 one within these tokens, so the reference below is not the float32 engine's."""
    return hc.make(tmp_path_factory.mktemp("cast") / "ckpt", replace(hc.SPEC_BF16, dtype="float32"))


@pytest.fixture(scope="module")
def reference(ckpt):
    runs = {}
    for state in ("bfloat16", "float32"):
        with _engine(ckpt, 1, state) as llm:
            outs = llm.generate(prompt_token_ids=hc.prompts(lens=PROMPT_LENS), sampling_params=SP)
            runs[state] = [o.output_token_ids for o in outs]
    assert runs["bfloat16"] != runs["float32"], "the checkpoint no longer tells the two states apart"
    return runs["bfloat16"]


@contextmanager
def _node(path: str, tp: int, state: str, role: str, name: str) -> Iterator[EngineCore]:
    """An engine with a NIXL endpoint of `role` next to each rank's pools."""
    llm = _engine(path, tp, state)
    core = llm.engine
    assert core is not None
    try:
        core.executor.call_all(xr.open_endpoint, role, name, TransferConfig(backend="nixl", checksum=True))
        yield core
    finally:
        core.executor.call_all(xr.close, "nixl")
        llm.close()


@pytest.fixture(scope="module")
def decode(ckpt):
    with _node(ckpt, 1, "bfloat16", "receiver", "D") as D:
        yield D


@pytest.mark.parametrize("a", [1, 2], ids=["tp1-to-1", "tp2-to-1"])
def test_float32_prefill_feeds_a_bfloat16_decode_engine(ckpt, decode, reference, a):
    D = decode
    with _node(ckpt, a, "float32", "sender", f"P{a}") as P:
        P.executor.call_all(xr.add_peers, "nixl", D.executor.call_all(_metadata, "nixl"))
        D.executor.call_all(xr.add_peers, "nixl", P.executor.call_all(_metadata, "nixl"))
        digest = D.executor.call_all(xr.digest, "nixl")[0]
        free = (D.blocks.num_free, D.slots.num_free)
        for i, prompt in enumerate(hc.prompts(lens=PROMPT_LENS)):
            rid = f"cast-{a}-{i}"
            dst_blocks, dst_slot, cached = D.reserve(prompt, SP, rid)
            inc = secrets.randbits(62)
            ranks = D.executor.call_all(xr.adopt, "nixl", rid, len(prompt), dst_blocks, dst_slot, None, inc, cached)
            target = xr.make_target(ranks, "D", rid, len(prompt), 1, digest, cached)
            P.add_request(prompt, SP, rid, prefill_only=True)
            out = None
            while out is None:
                out = next((o for o in P.step() if o.request_id == rid and o.finished), None)
            src_blocks, src_slot = P.held(rid)
            P.executor.call_all(xr.send, "nixl", rid, target, src_blocks, src_slot, len(prompt))
            _until(P, D, "nixl", rid, inc)
            want = reshard(D.cfg, to_global(P.cfg, P.executor.call_all(read_state, src_blocks, src_slot)), 0)
            (got,) = D.executor.call_all(read_state, dst_blocks[cached : len(src_blocks)], dst_slot)
            for layer, rec in want["rec"].items():
                assert rec.dtype == torch.float32 and got["rec"][layer].dtype == torch.bfloat16
                assert torch.equal(got["rec"][layer].view(torch.int16), rec.to(torch.bfloat16).view(torch.int16))
            for layer, conv in want["conv"].items():
                assert torch.equal(got["conv"][layer], conv)
            P.executor.call_all(xr.forget_send, "nixl", rid)
            P.release(rid)
            D.executor.call_all(xr.take, "nixl", rid, inc)
            assert decode_after(D, rid, out.output_token_ids[0]) == reference[i], f"prompt of {len(prompt)} tokens"
        assert (D.blocks.num_free, D.slots.num_free) == free

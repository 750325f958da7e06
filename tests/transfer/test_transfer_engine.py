"""The real engine on both sides: a prefill engine at TP=a computes a prompt and holds its
state; its ranks WRITE it (NIXL or UCXX, separate processes when TP > 1) into a decode engine's
reservation at TP=b. Each destination rank then holds, bit for bit, the source state carried
through the global layout and re-sharded for TP=b; and decoding from it gives the same tokens
as the colocated engine."""

from __future__ import annotations

import secrets
import time

import pytest
import torch

from engine import SamplingParams
from engine.core import EngineCore
from engine.llm import LLM
from engine.shard import conv_channel_index, head_range, kv_head_range
from tests.helpers import hybrid_ckpt as hc
from transfer import TransferConfig
from transfer import rank as xr

SP = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPT_LENS = (37, 70)
TIMEOUT_S = 60.0


def read_state(worker, blocks: list[int], slot: int) -> dict:
    """(runs on a rank) a copy of one request's pages and slot."""
    p = worker.pools
    idx = torch.tensor(blocks)
    return {
        "kv": {i: t[idx].clone() for i, t in p.kv.items()},
        "conv": {i: t[slot].clone() for i, t in p.conv.items()},
        "rec": {i: t[slot].clone() for i, t in p.recurrent.items()},
    }


def to_global(cfg, shards: list[dict]) -> dict:
    """Source ranks' pieces -> the unsharded state (through engine.shard, not the plan)."""
    m, t = cfg.model, cfg.parallel.tensor_parallel_size
    out = {"kv": {}, "conv": {}, "rec": {}}
    for i in shards[0]["kv"]:
        nb, _, _, bs, hd = shards[0]["kv"][i].shape
        g = torch.empty((nb, 2, m.num_kv_heads, bs, hd), dtype=m.dtype)
        for r, s in enumerate(shards):
            g[:, :, list(kv_head_range(m.num_kv_heads, t, r))] = s["kv"][i]
        out["kv"][i] = g
    for i in shards[0]["conv"]:
        conv = torch.empty((m.conv_dim, m.linear_conv_kernel_dim - 1), dtype=m.dtype)
        rec = torch.empty((m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim))
        for r, s in enumerate(shards):
            conv[conv_channel_index(m, t, r)] = s["conv"][i]
            rec[list(head_range(m.linear_num_value_heads, t, r))] = s["rec"][i]
        out["conv"][i], out["rec"][i] = conv, rec
    return out


def reshard(cfg, g: dict, rank: int) -> dict:
    m, t = cfg.model, cfg.parallel.tensor_parallel_size
    return {
        "kv": {i: v[:, :, list(kv_head_range(m.num_kv_heads, t, rank))] for i, v in g["kv"].items()},
        "conv": {i: v[conv_channel_index(m, t, rank)] for i, v in g["conv"].items()},
        "rec": {i: v[list(head_range(m.linear_num_value_heads, t, rank))] for i, v in g["rec"].items()},
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def decode_after(D: EngineCore, rid: str, first: int) -> list[int]:
    """Activate a handed-off request on the decode engine with its first token; its tokens to the end."""
    toks = D.activate(rid, first).new_token_ids
    while D.has_unfinished():
        toks += sum((o.new_token_ids for o in D.step() if o.request_id == rid), [])
    return toks


def engine(path: str, tp: int, **kw) -> LLM:
    return LLM(path, dtype="float32", tensor_parallel_size=tp, kv_cache_memory="24MiB", max_num_seqs=8, **kw)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return hc.make(tmp_path_factory.mktemp("xfer") / "ckpt", hc.SPEC_HV2)


@pytest.fixture(scope="module")
def engines(ckpt):
    """Prefill and decode engines at TP 1 and 2, each rank with a NIXL and a UCXX endpoint."""
    es = {}
    for role, node in (("sender", "P"), ("receiver", "D")):
        for tp in (1, 2):
            llm = engine(ckpt, tp)
            for backend in ("nixl", "ucxx"):
                cfg = TransferConfig(backend=backend, checksum=True)
                llm.engine.executor.call_all(xr.open_endpoint, role, f"{node}{tp}", cfg)
            es[(node, tp)] = llm
    yield {k: llm.engine for k, llm in es.items()}
    for llm in es.values():
        for backend in ("nixl", "ucxx"):
            llm.engine.executor.call_all(xr.close, backend)
        llm.close()


@pytest.fixture(scope="module")
def colocated(ckpt):
    with LLM(ckpt, dtype="float32") as llm:
        yield [
            o.output_token_ids for o in llm.generate(prompt_token_ids=hc.prompts(lens=PROMPT_LENS), sampling_params=SP)
        ]


def _connect(P: EngineCore, D: EngineCore, backend: str, done: set) -> None:
    if (id(P), id(D), backend) in done:
        return
    p_meta = P.executor.call_all(_metadata, backend)
    d_meta = D.executor.call_all(_metadata, backend)
    P.executor.call_all(xr.add_peers, backend, d_meta)
    D.executor.call_all(xr.add_peers, backend, p_meta)
    done.add((id(P), id(D), backend))


def _metadata(worker, backend: str) -> bytes:
    return xr.endpoint(worker, backend).metadata()


def _until(P, D, backend, rid, inc, want_quiet=True):
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        src = [r[0] for r in P.executor.call_all(xr.poll_sends, backend, [rid])]
        dst = [r[0] for r in D.executor.call_all(xr.poll_reservations, backend, [(rid, inc)])]
        if any(s.state == "failed" for s in src + dst):
            raise AssertionError(f"transfer failed: {src} {dst}")
        if all(s.state == "done" for s in dst) and all(s.state == "done" and (s.quiet or not want_quiet) for s in src):
            return
    raise AssertionError(f"transfer did not finish within {TIMEOUT_S} s")


PAIRS = [("nixl", 1, 1), ("nixl", 2, 1), ("nixl", 1, 2), ("nixl", 2, 2), ("ucxx", 2, 1), ("ucxx", 1, 2)]
_connected: set = set()


def _prefill_and_push(P: EngineCore, D: EngineCore, backend: str, rid: str, prompt, b: int, digest: str):
    """D reserves, P prefills (prefill-only) and pushes; once every rank is done and D holds,
    bit for bit, P's state re-sharded for TP=b, P releases. Returns P's finished output."""
    dst_blocks, dst_slot, cached = D.reserve(prompt, SP, rid)  # cached: pages D holds from an earlier run
    inc = secrets.randbits(62)
    ranks = D.executor.call_all(xr.adopt, backend, rid, len(prompt), dst_blocks, dst_slot, None, inc, cached)
    target = xr.make_target(ranks, f"D{b}", rid, len(prompt), b, digest, cached)
    P.add_request(prompt, SP, rid, prefill_only=True)
    out = None
    while out is None:
        out = next((o for o in P.step() if o.request_id == rid and o.finished), None)
    assert out.finish_reason == "prefilled"
    src_blocks, src_slot = P.held(rid)
    assert len(src_blocks) == -(-len(prompt) // P.cfg.cache.block_size)  # the prompt's pages only
    P.executor.call_all(xr.send, backend, rid, target, src_blocks, src_slot, len(prompt))
    _until(P, D, backend, rid, inc)
    want = to_global(P.cfg, P.executor.call_all(read_state, src_blocks, src_slot))
    # the pages sent (not those D had cached: another prefill engine computed them) and the state
    got = D.executor.call_all(read_state, dst_blocks[cached : len(src_blocks)], dst_slot)
    for r, g in enumerate(got):
        exp = reshard(D.cfg, want, r)
        exp["kv"] = {layer: kv[cached:] for layer, kv in exp["kv"].items()}
        for kind in ("kv", "conv", "rec"):
            for layer in exp[kind]:
                assert same_bits(g[kind][layer], exp[kind][layer]), f"rank {r} {kind} layer {layer} differs"
    P.executor.call_all(xr.forget_send, backend, rid)
    P.release(rid)
    D.executor.call_all(xr.take, backend, rid, inc)
    return out, want


@pytest.mark.parametrize("backend,a,b", PAIRS, ids=[f"{be}-tp{a}to{b}" for be, a, b in PAIRS])
def test_engine_prefill_transfer_decode(engines, colocated, backend, a, b):
    P, D = engines[("P", a)], engines[("D", b)]
    _connect(P, D, backend, _connected)
    free = (P.blocks.num_free, P.slots.num_free, D.blocks.num_free, D.slots.num_free)
    digest = D.executor.call_all(xr.digest, backend)[0]
    for i, prompt in enumerate(hc.prompts(lens=PROMPT_LENS)):
        rid = f"{backend}-{a}{b}-{i}"
        out, _ = _prefill_and_push(P, D, backend, rid, prompt, b, digest)
        assert decode_after(D, rid, out.output_token_ids[0]) == colocated[i], f"prompt of {len(prompt)} tokens"
    assert (P.blocks.num_free, P.slots.num_free, D.blocks.num_free, D.slots.num_free) == free


# ---- MTP drafting: the drafter's KV travels as its own kind, and the drafts go with the first token

MTP_PAIRS = [(1, 2), (2, 1)]


def mtp_engine(path: str, tp: int, **kw) -> LLM:
    return LLM(
        path,
        dtype="float32",
        tensor_parallel_size=tp,
        kv_cache_memory="24MiB",
        max_num_seqs=8,
        speculative_method="mtp",
        num_speculative_tokens=2,
        **kw,
    )


@pytest.fixture(scope="module")
def ckpt_mtp(tmp_path_factory):
    return hc.make(tmp_path_factory.mktemp("xfer-mtp") / "ckpt", hc.SPEC_MTP)


def _draft_trace(engine: EngineCore, rid: str, outs) -> tuple[list[int], list[list[int]]]:
    """Step until `rid` finishes: its tokens and the drafts it held after every step."""
    toks = sum((o.new_token_ids for o in outs if o.request_id == rid), [])
    drafts = [list(engine.requests[rid].draft_token_ids)] if rid in engine.requests else []
    while engine.has_unfinished():
        outs = engine.step()
        toks += sum((o.new_token_ids for o in outs if o.request_id == rid), [])
        if rid in engine.requests:
            drafts.append(list(engine.requests[rid].draft_token_ids))
    return toks, drafts


def _second_turn(prompt: list[int], toks: list[int]) -> list[int]:
    return prompt + toks + hc.prompts(lens=(5,), seed=len(prompt))[0]


@pytest.fixture(scope="module")
def mtp_colocated(ckpt_mtp):
    """(tokens, drafts after every step) of each prompt, then of its second turn (the prompt, its
    tokens and 5 more), computed from scratch: no prefix cache."""
    out = []
    with mtp_engine(ckpt_mtp, 1, enable_prefix_caching=False) as llm:
        prompts = hc.prompts(lens=PROMPT_LENS)
        for turn in range(2):
            for i, prompt in enumerate(prompts):
                rid = f"colocated-{turn}-{i}"
                llm.engine.add_request(prompt if turn == 0 else _second_turn(prompt, out[i][0]), SP, rid)
                first = llm.engine.step()
                out.append(_draft_trace(llm.engine, rid, first))
    return out


@pytest.mark.parametrize("a,b", MTP_PAIRS, ids=[f"tp{a}to{b}" for a, b in MTP_PAIRS])
def test_mtp_state_and_drafts_cross_the_pools(ckpt_mtp, mtp_colocated, a, b):
    """The MTP layer's KV arrives bit for bit next to the main KV and GDN state (re-sharded a -> b),
    and the decode side then drafts exactly what the colocated engine drafts at every step, from
    its first step (the prefill side's drafts) on: same drafts, so the same acceptance. Then each
    prompt's second turn: the prefill side resumes from its cached prefix, the decode side holds
    the prompt's leading pages (the MTP layer's KV in them included) from the first turn and takes
    only the rest; still the drafts of a colocated run without a cache. The leading pages include
    the first turn's full reply pages, whose MTP KV the decode side computed while decoding."""
    backend = "nixl"
    llms = (mtp_engine(ckpt_mtp, a), mtp_engine(ckpt_mtp, b))
    P, D = (llm.engine for llm in llms)
    try:
        for e, role, node in ((P, "sender", f"P{a}"), (D, "receiver", f"D{b}")):
            e.executor.call_all(xr.open_endpoint, role, node, TransferConfig(backend=backend, checksum=True))
        _connect(P, D, backend, set())
        digest = D.executor.call_all(xr.digest, backend)[0]
        mtp_layer = P.cfg.model.num_layers
        for i, prompt in enumerate(hc.prompts(lens=PROMPT_LENS)):
            rid = f"mtp-{a}{b}-{i}"
            out, want = _prefill_and_push(P, D, backend, rid, prompt, b, digest)
            assert mtp_layer in want["kv"]  # the MTP layer's KV was compared with the rest
            first = D.activate(rid, out.output_token_ids[0], out.draft_token_ids)
            toks, drafts = _draft_trace(D, rid, [first])
            assert (toks, drafts) == mtp_colocated[i], f"prompt of {len(prompt)} tokens, tp {a} -> {b}"
        n = len(PROMPT_LENS)
        for i, prompt in enumerate(hc.prompts(lens=PROMPT_LENS)):
            rid = f"mtp-{a}{b}-turn2-{i}"
            turn2 = _second_turn(prompt, mtp_colocated[i][0])
            out, _ = _prefill_and_push(P, D, backend, rid, turn2, b, digest)
            computed = len(prompt) + len(mtp_colocated[i][0]) - 1  # the last token has no KV
            assert computed // 16 > len(prompt) // 16  # a reply page among them
            assert D.requests[rid].num_cached_blocks == computed // 16 and out.num_cached_tokens == len(prompt)
            first = D.activate(rid, out.output_token_ids[0], out.draft_token_ids)
            assert _draft_trace(D, rid, [first]) == mtp_colocated[n + i], f"second turn of {len(prompt)} tokens"
        for e in (P, D):
            assert not e.blocks.ref and e.blocks.num_free == e.capacity.num_blocks
    finally:
        for llm in llms:
            llm.engine.executor.call_all(xr.close, backend)
            llm.close()


# ---- a decode engine whose pools carry the padding slot and page of padded CUDA graphs


@pytest.fixture(scope="module")
def padded(ckpt):
    """A decode engine at TP 1 with the pools a CUDA decode node has (one GDN slot and one KV page
    past the counted ones, engine/model/graphs.py) and padded graph buffers (no capture: the CPU)."""
    import dataclasses

    from engine.cache.allocator import CachePools
    from engine.model.graphs import DecodeGraphs

    llm = engine(ckpt, 1)
    w = llm.engine.executor.worker
    w.pools = CachePools(w.specs, dataclasses.replace(w.capacity, padding=1), w.device)
    w.graphs = DecodeGraphs(w.model, w.pools, w.max_pages_per_row(), capture=False, buckets=(4, 8))
    w.graphs.capture_all(w.block_size)
    llm.engine.executor.call_all(xr.open_endpoint, "receiver", "Dpad", TransferConfig(backend="nixl", checksum=True))
    yield llm.engine
    llm.engine.executor.call_all(xr.close, "nixl")
    llm.close()


@pytest.mark.parametrize("a", [1, 2], ids=["tp1", "tp2"])
def test_a_decode_engine_with_padded_pools_takes_the_state(engines, padded, colocated, a):
    """The source's pools have no padding, the destination's have a slot and a page more: the
    state still lands bit for bit (each side's plan reads its own pool shapes), and the padded
    decode steps give the colocated engine's tokens."""
    P, D = engines[("P", a)], padded
    _connect(P, D, "nixl", _connected)
    digest = D.executor.call_all(xr.digest, "nixl")[0]
    g = D.executor.worker.graphs
    before = g.covered
    for i, prompt in enumerate(hc.prompts(lens=PROMPT_LENS)):
        rid = f"pad-{a}-{i}"
        out, _ = _prefill_and_push(P, D, "nixl", rid, prompt, 1, digest)
        assert decode_after(D, rid, out.output_token_ids[0]) == colocated[i], f"prompt of {len(prompt)} tokens"
    assert g.covered - before >= 10  # the decode steps ran padded: one row in a bucket of 4

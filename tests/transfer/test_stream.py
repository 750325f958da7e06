"""KV streamed per prefill chunk between two real engines (NIXL over loopback, rank processes
when TP > 1, checksums on): a prompt of many chunks opens its push with its first chunk, each
finished chunk's full pages land in the decode node's reservation while later chunks compute,
each layer's rest (the last chunk's pages, the last partial page, the GDN state) goes as the last
chunk's forward finishes the layer, and decoding from the state gives transformers' greedy tokens
at TP pairs (1,1), (2,1), (1,2), as the single push does. A request cancelled
mid-stream (TP 2 -> 1) or preempted mid-stream leaves no page, slot, push or lease behind on
either side, and a prompt that streams longer than the push timeout is no failed push."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Literal

import pytest

from engine import SamplingParams
from engine.connector import RecvFreed, RecvReady, SendDone, TransferRecord
from engine.core import EngineCore
from engine.llm import LLM
from tests.helpers import hybrid_ckpt as hc
from tests.transfer.test_connector import _drive, _free
from tests.transfer.test_transfer_engine import read_state, same_bits
from transfer import TransferConfig
from transfer import rank as xr
from transfer.connector import DecodeConnector, PrefillConnector, PushParams, PushPhase, ReservationPhase
from transfer.messages import Target

NEW = 6
SP = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
CHUNK = 32  # --max-num-batched-tokens: the prompt runs in ceil(LEN / CHUNK) steps
LEN = 237  # 8 chunks, 14 full pages of 16 and a partial one
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return hc.make(tmp_path_factory.mktemp("stream") / "ckpt", hc.SPEC_HV2)  # as test_connector's


@pytest.fixture(scope="module")
def prompt_and_want(ckpt):
    p = hc.prompts(lens=(LEN,), seed=3)[0]
    return p, hc.hf_greedy(ckpt, p, NEW)


@contextmanager
def engines(
    ckpt: str, a: int, b: int, backend: Literal["nixl", "ucxx"] = "nixl", decode_progress: bool = False, **extra: Any
) -> Iterator[tuple[EngineCore, EngineCore, PrefillConnector, DecodeConnector]]:
    """A prefill engine at TP a and a decode engine at TP b in 32-token chunks (and `extra` LLM
    options), their connectors joined (NIXL unless `backend` says, checksums on). With
    `decode_progress`, the decode side's NIXL agents progress on their own thread, as a decode
    node's loop progresses them while this test's thread waits on the prefill side."""
    kw: dict[str, Any] = dict(dtype="float32", kv_cache_memory="24MiB", max_num_seqs=4, max_num_batched_tokens=CHUNK)
    kw.update(extra)
    with LLM(ckpt, tensor_parallel_size=a, **kw) as p, LLM(ckpt, tensor_parallel_size=b, **kw) as d:
        cfg = TransferConfig(backend=backend, checksum=True, lease_s=30.0)
        pc = PrefillConnector(p.engine.executor, "P", cfg, push_timeout_s=30.0)
        dc = DecodeConnector(d.engine.executor, "D", replace(cfg, nixl_progress_thread=decode_progress))
        p.engine.use_connector(pc)
        d.engine.use_connector(dc)
        assert pc.add_peers(dc.blobs) and dc.add_peers(pc.blobs)
        try:
            yield p.engine, d.engine, pc, dc
        finally:
            pc.close()
            dc.close()


@pytest.fixture(scope="module", params=[(1, 1), (2, 1), (1, 2)], ids=["tp1to1", "tp2to1", "tp1to2"])
def pair(request, ckpt):
    a, b = request.param
    with engines(ckpt, a, b) as (P, D, pc, dc):
        yield P, D, pc, dc, (a, b)


def _target(D: EngineCore, rid: str, prompt: list[int], tp: int) -> Target:
    got = D.reserve_transfer(prompt, SP, rid, 30.0)
    assert got is not None and isinstance(D.connector, DecodeConnector)
    (_, _, cached), ranks = got
    assert isinstance(ranks, list)
    return Target(rid, "D", tp, D.connector.digest, len(prompt), ranks, cached)


def test_a_long_prompt_streams_chunk_by_chunk_and_decodes_like_transformers(pair, prompt_and_want):
    P, D, pc, dc, (a, b) = pair
    prompt, want = prompt_and_want
    p0, d0 = _free(P), _free(D)
    target = _target(D, "s1", prompt, b)
    P.add_request(prompt, SP, "s1", prefill_only=True, transfer=PushParams(target, lease_s=30.0))
    P.step()  # the first chunk: the push opened with it (every page of the prompt named)
    assert pc.phase("s1") is PushPhase.OPENED
    records: list[TransferRecord] = []
    steps, first = 1, None
    while first is None:
        if (a, b) == (1, 1) and steps == 4:  # 4 chunks (128 tokens, 8 pages) done: they landed already
            deadline = time.monotonic() + TIMEOUT_S
            src = P.executor.call_all(read_state, P.requests["s1"].block_ids[:8], P.requests["s1"].slot)[0]
            dst_blocks = D.requests["s1"].block_ids[:8]
            while not all(
                same_bits(src["kv"][i], d)
                for i, d in D.executor.call_all(read_state, dst_blocks, D.requests["s1"].slot)[0]["kv"].items()
            ):
                assert time.monotonic() < deadline, "the first chunks' pages never landed"
                records += P.poll_transfers() + D.poll_transfers()
            assert dc.phase("s1") is ReservationPhase.WAITING  # not ready before the last piece
        first = next((o.new_token_ids[0] for o in P.step() if o.request_id == "s1"), None)
        steps += 1
        if first is None:
            assert pc._pushes["s1"].chunks == steps  # each chunk but the last wrote its pages at once
        else:  # then each layer's rest, as the last chunk's forward finished it: one WRITE per layer
            assert pc._pushes["s1"].by_layer
            per_rank = P.executor.call_all(xr.poll_sends, "nixl", ["s1"])
            assert [s.writes for (s,) in per_rank] == [(steps - 1 + P.cfg.model.num_layers) * b] * a
        records += P.poll_transfers() + D.poll_transfers()
    assert steps == -(-LEN // CHUNK)
    _drive(P, D, lambda: not pc.tracks("s1") and dc.phase("s1") is ReservationPhase.READY, records)
    sent = [r for r in records if isinstance(r, SendDone)]
    assert len(sent) == 1 and sent[0].error is None and sent[0].nbytes > 0
    assert RecvReady("s1") in records
    D.activate("s1", first)
    toks = [first]
    while D.has_unfinished():
        toks += [t for o in D.step() for t in o.new_token_ids]
    assert toks == want
    assert _free(P) == p0 and _free(D) == d0 and not pc.has_work() and not dc.stats().in_flight


def test_a_prompt_streaming_longer_than_the_push_timeout_is_no_failed_push(pair):
    """The push's deadline counts from its last streamed chunk (and from its post), not from
    its Begin: a long prompt streams for as long as its chunks keep coming."""
    P, D, pc, dc, (a, b) = pair
    if (a, b) != (1, 1):
        pytest.skip("one TP pair is enough")
    prompt = hc.prompts(lens=(LEN,), seed=4)[0]  # not in either prefix cache
    p0, d0 = _free(P), _free(D)
    target = _target(D, "s3", prompt, b)
    P.add_request(prompt, SP, "s3", prefill_only=True, transfer=PushParams(target, lease_s=30.0))
    timeout, pc.push_timeout_s = pc.push_timeout_s, 0.4
    records: list[TransferRecord] = []
    try:
        while "s3" in P.requests and P.requests["s3"].output_token_ids == []:
            P.step()
            records += P.poll_transfers() + D.poll_transfers()
            time.sleep(0.15)  # 8 chunks: 1.2 s from the Begin to the first token
        _drive(P, D, lambda: not pc.tracks("s3") and dc.phase("s3") is ReservationPhase.READY, records)
    finally:
        pc.push_timeout_s = timeout
    sent = [r for r in records if isinstance(r, SendDone)]
    assert len(sent) == 1 and sent[0].error is None, sent
    D.release("s3")
    _drive(P, D, lambda: RecvFreed("s3") in records, records)
    assert _free(P) == p0 and _free(D) == d0


def test_a_request_preempted_mid_stream_fails_its_push_and_frees_everything(pair):
    """Preempted (its pages go back and are recomputed, whatever ids it gets next): the pages
    already written may have been read while another request rewrote them, so the push fails at
    the next chunk and both sides get their memory back."""
    P, D, pc, dc, (a, b) = pair
    if (a, b) != (1, 1):
        pytest.skip("one TP pair is enough")
    prompt = hc.prompts(lens=(LEN,), seed=6)[0]
    p0, d0 = _free(P), _free(D)
    target = _target(D, "s4", prompt, b)
    P.add_request(prompt, SP, "s4", prefill_only=True, transfer=PushParams(target, lease_s=30.0))
    P.step()
    P.step()
    P.scheduler._preempt(P.requests["s4"])  # what memory pressure does to the running batch's last
    records: list[TransferRecord] = []
    _drive(P, D, lambda: not pc.tracks("s4") and RecvFreed("s4") in records, records)
    sent = [r for r in records if isinstance(r, SendDone)]
    assert len(sent) == 1 and "preempted" in (sent[0].error or ""), sent
    assert _free(P) == p0 and _free(D) == d0 and not P.requests and not D.requests
    assert not pc.has_work() and not dc.stats().in_flight


def test_a_cancel_mid_stream_leaves_nothing_on_either_side(pair):
    P, D, pc, dc, (a, b) = pair
    if (a, b) != (2, 1):
        pytest.skip("one TP pair is enough for the cancel: two source ranks abort")
    prompt = hc.prompts(lens=(LEN,), seed=5)[0]  # not in either prefix cache
    p0, d0 = _free(P), _free(D)
    target = _target(D, "s2", prompt, b)
    P.add_request(prompt, SP, "s2", prefill_only=True, transfer=PushParams(target, lease_s=30.0))
    for _ in range(3):
        P.step()
    assert pc.phase("s2") is PushPhase.OPENED and pc._pushes["s2"].chunks == 3
    P.abort("s2")  # the client went away: the push ends, and the decode node hears of it
    records: list[TransferRecord] = []
    _drive(P, D, lambda: not pc.tracks("s2") and RecvFreed("s2") in records, records)
    sent = [r for r in records if isinstance(r, SendDone)]
    assert len(sent) == 1 and sent[0].aborted
    assert _free(P) == p0 and _free(D) == d0 and not P.requests and not D.requests
    assert not pc.has_work() and not dc.stats().in_flight  # no lease renewed, no reservation left

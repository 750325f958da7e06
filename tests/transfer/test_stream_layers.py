"""A streamed push's last chunk, posted layer by layer (NIXL over loopback, checksums on): with
MTP drafting, the drafter's KV (no decoder layer of the forward) goes with the final post and the
decode side's tokens are transformers', and over UCXX (no page per chunk) the same; when the prefill side fails inside that chunk's forward
after some layers went out, a step that raises and a cancel, or a prefill node whose ranks die
(TP 2 -> 1) and that the router then declares dead, leave no page, slot, push, reservation or
lease behind on either side that lives. On a GPU (marked `gpu`), each layer's post waits for the
event recorded after its kernels, and the decode side's tokens are still transformers'."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal

import pytest

from engine import SamplingParams
from engine.connector import LayerConnector, RecvFailed, RecvFreed, SendDone, TransferRecord
from engine.core import EngineCore
from engine.executor import WorkerError
from engine.worker import Worker
from tests.helpers import hybrid_ckpt as hc
from tests.transfer.test_connector import _drive, _free
from tests.transfer.test_stream import CHUNK, engines
from tests.transfer.test_transfer_engine import read_state, same_bits
from transfer import rank as xr
from transfer.connector import DecodeConnector, PrefillConnector, PushParams, PushPhase, ReservationPhase
from transfer.messages import Target

SP = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
LEN = 150  # 5 chunks
DIE_AFTER = 2  # the forward fails once this layer's post went out


class _Killed(RuntimeError):
    pass


class _DieAfter(LayerConnector):
    """The rank's own layer connector, then a failure once layer `layer` was posted."""

    def __init__(self, inner: LayerConnector, layer: int) -> None:
        self.inner, self.layer = inner, layer

    def layer_done(self, request_ids: Sequence[str], layer: int, mark) -> None:
        self.inner.layer_done(request_ids, layer, mark)
        if layer == self.layer:
            raise _Killed(f"the prefill died after layer {layer}")


def _die_after(worker: Worker, layer: int) -> None:
    """Run on every rank (by name, so rank processes can import it)."""
    assert worker.layer_connector is not None
    worker.use_layer_connector(_DieAfter(worker.layer_connector, layer))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return hc.make(tmp_path_factory.mktemp("layers") / "ckpt", hc.SPEC_HV2)


def _submit(P: EngineCore, D: EngineCore, rid: str, prompt: list[int], b: int) -> None:
    """Reserve on D (TP b), then queue the prompt on P as a prefill-only request pushing there."""
    got = D.reserve_transfer(prompt, SP, rid, 30.0)
    assert got is not None and isinstance(D.connector, DecodeConnector)
    (_, _, cached), ranks = got
    assert isinstance(ranks, list)
    target = Target(rid, "D", b, D.connector.digest, len(prompt), ranks, cached)
    P.add_request(prompt, SP, rid, prefill_only=True, transfer=PushParams(target, lease_s=30.0))


def _start(P: EngineCore, D: EngineCore, pc: PrefillConnector, rid: str, b: int) -> None:
    """Reserve on D, then run every chunk but the last on P (their pages stream), with the
    forward set to fail inside the last chunk after layer DIE_AFTER."""
    _submit(P, D, rid, hc.prompts(lens=(LEN,), seed=21)[0], b)
    for _ in range(-(-LEN // CHUNK) - 1):
        P.step()
        P.poll_transfers()  # the grants, as a node's loop polls each step
        D.poll_transfers()
    assert pc.phase(rid) is PushPhase.OPENED and pc._pushes[rid].chunks == -(-LEN // CHUNK) - 1
    P.executor.call_all(_die_after, DIE_AFTER)


def test_a_step_failing_mid_last_chunk_then_a_cancel_leaves_nothing(ckpt):
    with engines(ckpt, 1, 1) as (P, D, pc, dc):
        p0, d0 = _free(P), _free(D)
        _start(P, D, pc, "k1", 1)
        with pytest.raises(_Killed):
            P.step()  # the last chunk: layers 0..DIE_AFTER went out, then the forward failed
        assert pc._pushes["k1"].by_layer
        (st,) = P.executor.call_all(xr.poll_sends, "nixl", ["k1"])[0]
        assert st.writes == (-(-LEN // CHUNK) - 1) + DIE_AFTER + 1  # the chunks' pages, then 3 layers
        P.abort("k1")  # the node cancels what its failed step held
        records: list[TransferRecord] = []
        _drive(P, D, lambda: not pc.tracks("k1") and RecvFreed("k1") in records, records)
        sent = [r for r in records if isinstance(r, SendDone)]
        assert len(sent) == 1 and sent[0].aborted, sent
        assert _free(P) == p0 and _free(D) == d0 and not P.requests and not D.requests
        assert not pc.has_work() and not dc.stats().in_flight


def test_a_prefill_node_killed_mid_last_chunk_leaves_the_decode_node_nothing(ckpt):
    # the decode side progresses while P.step() waits for P's failing ranks, which drain their
    # writes before they exit (a write read after its writer's socket closed aborts in UCX)
    with engines(ckpt, 2, 1, decode_progress=True) as (P, D, pc, dc):
        d0 = _free(D)
        _start(P, D, pc, "k2", 1)
        with pytest.raises(WorkerError):
            P.step()  # both ranks' forwards fail after layer DIE_AFTER: the executor stops its ranks
        records: list[TransferRecord] = []
        assert dc.drop_node("P")  # the router declared the prefill node dead
        deadline = time.monotonic() + 30
        while RecvFreed("k2") not in records:
            assert time.monotonic() < deadline, records
            records += D.poll_transfers()
        failed = [r for r in records if isinstance(r, RecvFailed)]
        assert len(failed) == 1 and failed[0].request_id == "k2", records
        assert _free(D) == d0 and not D.requests and not dc.stats().in_flight  # no page, slot or lease left


@pytest.mark.gpu
def test_on_a_gpu_each_layer_waits_for_its_event(ckpt):
    _push_and_decode(ckpt, "g1", device="cuda")


def test_over_ucxx_the_last_chunks_layers_go_whole(ckpt):
    """UCXX writes no page per chunk (its tags number the whole plan's ranges), then each layer's
    ranges whole as the last chunk finishes it."""
    _push_and_decode(ckpt, "u1", backend="ucxx")


def test_with_mtp_drafting_the_drafters_kv_goes_with_the_final_post(tmp_path):
    _push_and_decode(hc.make(tmp_path / "ckpt", hc.SPEC_MTP), "m1", speculative_method="mtp", num_speculative_tokens=2)


def _push_and_decode(ckpt: str, rid: str, backend: Literal["nixl", "ucxx"] = "nixl", **extra: Any) -> None:
    """A 4-chunk prompt streamed with its last chunk posted layer by layer (TP 1 -> 1): the
    prompt's full pages (every layer's, the drafter's included) and GDN state land bit for bit,
    and decoding from them gives transformers' tokens; nothing is left on either side."""
    prompt = hc.prompts(lens=(100,), seed=22)[0]
    want = hc.hf_greedy(ckpt, prompt, SP.max_tokens)
    with engines(ckpt, 1, 1, backend, **extra) as (P, D, pc, dc):
        p0, d0 = _free(P), _free(D)
        _submit(P, D, rid, prompt, 1)
        records: list[TransferRecord] = []
        first = None
        while first is None:
            first = next((o.new_token_ids[0] for o in P.step() if o.request_id == rid), None)
            records += P.poll_transfers() + D.poll_transfers()
        assert pc._pushes[rid].by_layer
        held, n = P.requests[rid], len(prompt) // P.cfg.cache.block_size  # its full pages, bit for bit
        src = P.executor.call_all(read_state, held.block_ids[:n], held.slot)[0]
        drafts = list(held.draft_token_ids)
        _drive(P, D, lambda: not pc.tracks(rid) and dc.phase(rid) is ReservationPhase.READY, records)
        dst = D.executor.call_all(read_state, D.requests[rid].block_ids[:n], D.requests[rid].slot)[0]
        assert P.cfg.speculative.mtp == (P.cfg.model.num_layers in src["kv"])  # the drafter's layer
        assert [(k, i) for k in src for i in src[k] if not same_bits(src[k][i], dst[k][i])] == []
        D.activate(rid, first, drafts)
        toks = [first]
        while D.has_unfinished():
            toks += [t for o in D.step() for t in o.new_token_ids]
        assert toks == want
        assert _free(P) == p0 and _free(D) == d0

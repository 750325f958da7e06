"""The connector between two real engines in one process (TP 1, NIXL over loopback): the
prefill engine's PrefillConnector pushes a computed prompt into the decode engine's reservation,
which the DecodeConnector adopted; the engines themselves call the connectors and free what a
transfer held when its poll says so. Each test checks the phases on the way, the typed records,
that every page and slot comes back, and (for a push) that decoding from the transferred state
gives the tokens of a colocated run."""

from __future__ import annotations

import time

import pytest

from engine import SamplingParams
from engine.connector import RecvFailed, RecvFreed, RecvReady, SendDone, TransferRecord
from engine.core import EngineCore
from engine.llm import LLM
from engine.request import Status
from tests.helpers import hybrid_ckpt as hc
from transfer import TransferConfig
from transfer.connector import DecodeConnector, PrefillConnector, PushParams, PushPhase, ReservationPhase
from transfer.messages import Target

SP = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return hc.make(tmp_path_factory.mktemp("conn") / "ckpt", hc.SPEC_HV2)


@pytest.fixture(scope="module")
def pair(ckpt):
    kw = dict(dtype="float32", kv_cache_memory="24MiB", max_num_seqs=8, max_num_batched_tokens=32)
    with LLM(ckpt, **kw) as p, LLM(ckpt, **kw) as d:
        # the single push (opened with the last chunk); tests/transfer/test_stream.py streams
        pc = PrefillConnector(p.engine.executor, "P", TransferConfig(backend="nixl"), push_timeout_s=30.0, stream=False)
        dc = DecodeConnector(d.engine.executor, "D", TransferConfig(backend="nixl", lease_s=30.0))
        p.engine.use_connector(pc)
        d.engine.use_connector(dc)
        assert pc.add_peers(dc.blobs) and dc.add_peers(pc.blobs)
        yield p.engine, d.engine, pc, dc
        pc.close()
        dc.close()


@pytest.fixture(scope="module")
def colocated(ckpt):
    with LLM(ckpt, dtype="float32") as llm:
        return [o.output_token_ids for o in llm.generate(prompt_token_ids=hc.prompts(lens=(70,)), sampling_params=SP)]


def _free(e: EngineCore) -> tuple[int, int]:
    return e.blocks.num_free, e.slots.num_free


def _target(D: EngineCore, rid: str, prompt: list[int], lease_s: float = 0.0) -> Target:
    got = D.reserve_transfer(prompt, SP, rid, lease_s or None)
    assert got is not None and isinstance(D.connector, DecodeConnector)
    (blocks, slot, cached), ranks = got
    assert isinstance(ranks, list)  # the decode connector's answer: every rank's TargetRank
    assert [r.blocks for r in ranks] == [blocks] and [r.slot for r in ranks] == [slot]
    return Target(rid, "D", 1, D.connector.digest, len(prompt), ranks, cached)


def _drive(P: EngineCore, D: EngineCore, until, records: list[TransferRecord]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not until():
        assert time.monotonic() < deadline, f"not there within {TIMEOUT_S} s: {records}"
        if P.has_unfinished():
            P.step()
        records += P.poll_transfers() + D.poll_transfers()


def test_a_push_lands_and_decodes_like_the_colocated_engine(pair, colocated):
    P, D, pc, dc = pair
    p0, d0 = _free(P), _free(D)
    prompt = hc.prompts(lens=(70,))[0]
    target = _target(D, "r1", prompt)
    assert dc.phase("r1") is ReservationPhase.WAITING and D.requests["r1"].status is Status.RESERVED
    P.add_request(prompt, SP, "r1", prefill_only=True, transfer=PushParams(target))
    P.step()  # the first of three chunks (32 tokens a step): nothing opened yet
    assert pc.phase("r1") is None
    P.step()
    P.step()  # the last chunk ran: opened before it, posted once the first token existed
    assert P.requests["r1"].status is Status.HELD and pc.phase("r1") is PushPhase.POSTED
    first = P.requests["r1"].output_token_ids[0]
    records: list[TransferRecord] = []
    _drive(P, D, lambda: not pc.tracks("r1") and dc.phase("r1") is ReservationPhase.READY, records)
    sent = [r for r in records if isinstance(r, SendDone)]
    assert len(sent) == 1 and sent[0].error is None and not sent[0].aborted and sent[0].nbytes > 0
    assert RecvReady("r1") in records and D.transfer_state("r1") == RecvReady("r1")
    assert _free(P) == p0 and "r1" not in P.requests  # the held memory came back with SendDone
    assert P.transfer_stats().sends_done == 1 and D.transfer_stats().receives_ready == 1

    D.activate("r1", first)  # the connector takes the state
    assert dc.phase("r1") is None
    toks = [first]
    while D.has_unfinished():
        toks += [t for o in D.step() for t in o.new_token_ids]
    assert toks == colocated[0]
    assert _free(D) == d0


def test_a_released_reservation_fails_then_frees(pair):
    P, D, pc, dc = pair
    d0 = _free(D)
    _target(D, "r2", [5] * 40)
    assert D.release("r2", "the router gave up") is False  # a transfer holds it: freed by a poll
    assert dc.phase("r2") is ReservationPhase.FAILING
    assert D.transfer_state("r2") == RecvFailed("r2", "the router gave up")
    records: list[TransferRecord] = []
    _drive(P, D, lambda: RecvFreed("r2") in records, records)
    assert records[0] == RecvFailed("r2", "the router gave up") and "r2" not in D.requests
    assert _free(D) == d0
    with pytest.raises(KeyError):
        D.activate("r2", 1)


def test_activating_before_the_state_is_in_is_refused(pair):
    P, D, pc, dc = pair
    d0 = _free(D)
    _target(D, "r3", [7] * 20)
    with pytest.raises(RuntimeError, match="ended before decode began: waiting"):
        D.activate("r3", 1)
    assert D.requests["r3"].status is Status.RESERVED  # refused: still reserved
    D.release("r3")
    records: list[TransferRecord] = []
    _drive(P, D, lambda: RecvFreed("r3") in records, records)
    assert _free(D) == d0


def test_a_request_aborted_before_its_first_token_ends_its_opened_push(pair):
    P, D, pc, dc = pair
    p0, d0 = _free(P), _free(D)
    prompt = hc.prompts(lens=(70,))[0]
    target = _target(D, "r4", prompt, lease_s=9.0)
    P.add_request(prompt, SP, "r4", prefill_only=True, transfer=PushParams(target, lease_s=9.0))
    P.step()
    P.step()
    # the last chunk is next: run its scheduling hook alone, as the step would
    so = P.scheduler.schedule()
    P.connector.rows_scheduled(so)
    P.scheduler.abandon(so)
    assert pc.phase("r4") is PushPhase.OPENED
    P.abort("r4")  # before its first token: the push ends, aborted
    assert pc.phase("r4") is PushPhase.FAILING
    records: list[TransferRecord] = []
    D.release("r4")
    _drive(P, D, lambda: not pc.tracks("r4") and RecvFreed("r4") in records, records)
    sent = [r for r in records if isinstance(r, SendDone)]
    assert len(sent) == 1 and sent[0].aborted and sent[0].error == "the request ended before its first token"
    assert _free(P) == p0 and _free(D) == d0 and not P.requests and not D.requests
    assert not pc.has_work()  # its lease is no longer renewed


def test_a_late_lease_renewal_says_what_to_change(pair, caplog):
    """Renewals run between engine steps: one that comes more than two thirds of the lease after
    the last (a step that long) logs a WARNING naming the options that fix it; the push still lands."""
    P, D, pc, dc = pair
    p0, d0 = _free(P), _free(D)
    prompt = hc.prompts(lens=(40,), seed=9)[0]
    target = _target(D, "r5", prompt, lease_s=3.0)
    P.add_request(prompt, SP, "r5", prefill_only=True, transfer=PushParams(target, lease_s=3.0))
    P.poll_transfers()  # on time: nothing said
    assert "reservation-lease" not in caplog.text
    time.sleep(2.2)  # a step of 2.2 s: 73 % of the lease since its last renewal
    with caplog.at_level("WARNING", logger="pdserve.transfer"):
        P.poll_transfers()
        warned = [r.getMessage() for r in caplog.records if "--reservation-lease" in r.getMessage()]
        assert len(warned) == 1 and "max-num-batched-tokens" in warned[0], warned
        records: list[TransferRecord] = []
        _drive(P, D, lambda: not pc.tracks("r5") and dc.phase("r5") is ReservationPhase.READY, records)
    D.release("r5")
    _drive(P, D, lambda: RecvFreed("r5") in records, records)
    assert _free(P) == p0 and _free(D) == d0


def _opened_and_begun(P: EngineCore, D: EngineCore, rid: str, prompt: list[int], sp: SamplingParams) -> list:
    """A push of `prompt` (two chunks) opened by its last chunk's scheduling hook, run alone as
    the step would, and its Begin received by the decode side; returns the records polled."""
    P.add_request(prompt, sp, rid, prefill_only=True, transfer=PushParams(_target(D, rid, prompt)))
    P.step()
    so = P.scheduler.schedule()
    assert P.connector is not None
    P.connector.rows_scheduled(so)
    P.scheduler.abandon(so)
    records: list[TransferRecord] = []
    for _ in range(20):
        records += P.poll_transfers() + D.poll_transfers()
        time.sleep(0.005)
    return records


def _fail_then_release(P: EngineCore, D: EngineCore, pc: PrefillConnector, rid: str, records: list) -> None:
    """Drive until the push ended and the reservation failed, then release it as the router does
    and drive until its memory is back."""
    _drive(P, D, lambda: not pc.tracks(rid) and RecvFailed in {type(r) for r in records}, records)
    D.release(rid)
    _drive(P, D, lambda: RecvFreed(rid) in records, records)


def _said_without_warning(caplog, rid: str, phrase: str) -> None:
    """The transfer logger said `phrase` of request `rid`, and nothing of it as a WARNING."""
    mine = [(r.levelname, r.getMessage()) for r in caplog.records if rid in r.getMessage()]
    assert any(phrase in m for _, m in mine), mine
    assert not [m for lv, m in mine if lv == "WARNING"], mine


def test_a_request_that_ends_at_its_first_token_frees_its_reservation_quietly(pair, caplog):
    """max_tokens 1: the prefill's first token ends the request (length) after its push opened
    and began but before it was posted, so the push is aborted; the decode side fails the
    reservation saying so at INFO, not as a WARNING (nothing went wrong, and an evaluation harness
    sends thousands of these), and frees it once the router releases it."""
    P, D, pc, dc = pair
    p0, d0 = _free(P), _free(D)
    prompt = hc.prompts(lens=(40,), seed=10)[0]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    with caplog.at_level("INFO", logger="pdserve.transfer"):
        records = _opened_and_begun(P, D, "r6", prompt, one)
        _fail_then_release(P, D, pc, "r6", records)
    _said_without_warning(caplog, "r6", "aborted: the request ended before its push (length)")
    sent = [r for r in records if isinstance(r, SendDone)]
    assert len(sent) == 1 and sent[0].aborted and sent[0].nbytes == 0
    assert _free(P) == p0 and _free(D) == d0


def test_a_cancelled_request_fails_its_push_and_reservation_quietly(pair, caplog):
    """The router releases a reservation whose client went away while the push is open: the decode
    side fails it and tells the source the release was asked for (Release.asked), so neither side
    logs the cancel as a WARNING; memory comes back on both."""
    P, D, pc, dc = pair
    p0, d0 = _free(P), _free(D)
    prompt = hc.prompts(lens=(40,), seed=11)[0]
    with caplog.at_level("INFO", logger="pdserve.transfer"):
        records = _opened_and_begun(P, D, "r7", prompt, SP)
        D.release("r7", "the caller went away")
        _drive(P, D, lambda: pc.phase("r7") in (PushPhase.FAILING, None), records)
        P.abort("r7")  # as the router cancels the prefill too
        _drive(P, D, lambda: not pc.tracks("r7") and RecvFreed("r7") in records, records)
    _said_without_warning(caplog, "r7", "released the reservation: the caller went away")
    assert _free(P) == p0 and _free(D) == d0 and "r7" not in P.requests


def test_a_prefill_cancelled_before_its_push_frees_the_reservation_quietly(pair, caplog):
    """The router cancels a prefill (its client went away) whose push began: the source's Abort
    says the request ended, so the decode side fails the reservation at INFO, not as a WARNING."""
    P, D, pc, dc = pair
    p0, d0 = _free(P), _free(D)
    prompt = hc.prompts(lens=(40,), seed=12)[0]
    with caplog.at_level("INFO", logger="pdserve.transfer"):
        records = _opened_and_begun(P, D, "r8", prompt, SP)
        P.abort("r8")
        _fail_then_release(P, D, pc, "r8", records)
    _said_without_warning(caplog, "r8", "source rank 0 aborted")
    assert _free(P) == p0 and _free(D) == d0


def test_a_failed_push_renews_no_lease(pair, monkeypatch):
    """A push that failed (its destination gone, or its request released) while its ranks are not
    yet quiet renews no lease: the reservation it kept alive is given up, and a destination that
    died is not asked again every third of the lease while the push settles."""
    import transfer.rank as xr

    P, D, pc, dc = pair
    p0, d0 = _free(P), _free(D)
    prompt = hc.prompts(lens=(70,), seed=13)[0]
    target = _target(D, "r9", prompt, lease_s=0.3)
    P.add_request(prompt, SP, "r9", prefill_only=True, transfer=PushParams(target, lease_s=0.3))
    P.step()
    P.step()
    so = P.scheduler.schedule()  # the last chunk's scheduling hook opens the push
    pc.rows_scheduled(so)
    P.scheduler.abandon(so)
    assert pc.phase("r9") is PushPhase.OPENED
    renewed: list = []
    real = pc.call_all

    def spy(fn, *args, **kw):
        if fn is xr.renew:
            renewed.extend(args[1])
        return real(fn, *args, **kw)

    monkeypatch.setattr(pc, "call_all", spy)
    pc.abort("r9", "the decode node is gone")
    time.sleep(0.15)  # past a third of the lease: a live lease is renewed at the next poll
    P.poll_transfers()
    assert target not in renewed and pc.phase("r9") is PushPhase.FAILING
    P.abort("r9")
    D.release("r9")
    records: list[TransferRecord] = []
    _drive(P, D, lambda: not pc.tracks("r9") and RecvFreed("r9") in records, records)
    assert _free(P) == p0 and _free(D) == d0 and not pc.has_work()


def test_a_push_into_a_reservation_released_just_before_is_refused_at_once(pair):
    """The router released a reservation (its client went away) just before the prefill node
    opened the push into it: the decode side, idle now, still reads the Begin and refuses it, so
    the prefill side frees its pages and slot at once; it held them for the source's whole grant
    timeout (30 s) while nothing polled the decode side's endpoint."""
    P, D, pc, dc = pair
    p0, d0 = _free(P), _free(D)
    prompt = hc.prompts(lens=(40,), seed=13)[0]
    target = _target(D, "r9", prompt)
    D.release("r9", "the client went away")
    records: list[TransferRecord] = []
    _drive(P, D, lambda: RecvFreed("r9") in records, records)
    assert not dc.tracks("r9") and _free(D) == d0
    P.add_request(prompt, SP, "r9", prefill_only=True, transfer=PushParams(target))
    P.step()
    so = P.scheduler.schedule()  # the last chunk's scheduling hook opens the push: its Begin goes out
    P.connector.rows_scheduled(so)
    P.scheduler.abandon(so)
    assert pc.phase("r9") is PushPhase.OPENED
    P.abort("r9")  # the router cancelled the prefill too
    deadline = time.monotonic() + 5.0
    while pc.tracks("r9"):
        assert time.monotonic() < deadline, f"the prefill side still holds r9's memory: {records}"
        records += P.poll_transfers() + D.poll_transfers()
        time.sleep(0.005)
    sent = [r for r in records if isinstance(r, SendDone)]
    assert len(sent) == 1 and sent[0].aborted
    assert _free(P) == p0 and _free(D) == d0 and "r9" not in P.requests

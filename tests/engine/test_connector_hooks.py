"""The engine calls its connector at each point of a request's life (engine/connector.py), in
order, on its own thread; the worker tells its layer connector of every layer of the step that
computes the last chunk of a request the connector chose, and of no other step; and a request
resumed with output tokens it already has (mid-stream failover) continues exactly as the
uninterrupted request does under greedy decoding."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.connector import Connector, LayerConnector, TransferRecord
from engine.request import Request
from tests.helpers import hybrid_ckpt as hc

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


class Recorder(Connector):
    """Records what the engine tells it; transfers nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.by_layer: set[str] = set()  # requests whose last chunk it asks the ranks for layer by layer

    def rows_scheduled(self, so) -> list[str]:
        return [
            r.request.request_id
            for r in so.rows
            if r.samples and not r.is_decode and r.request.request_id in self.by_layer
        ]

    def request_added(self, request: Request) -> None:
        self.calls.append(("added", request.request_id, request.kv_transfer))

    def request_resumed(self, request: Request) -> None:
        self.calls.append(("resumed", request.request_id, len(request.output_token_ids)))

    def prefill_chunk_done(self, request: Request, start: int, end: int) -> None:
        self.calls.append(("chunk", request.request_id, start, end))

    def prompt_prefilled(self, request: Request) -> None:
        self.calls.append(("prefilled", request.request_id))

    def request_finished(self, request: Request, reason: str) -> None:
        self.calls.append(("finished", request.request_id, reason))

    def tracks(self, request_id: str) -> bool:
        return False

    def abort(self, request_id: str, reason: str) -> bool:
        return False

    def poll(self) -> list[TransferRecord]:
        return []

    def has_work(self) -> bool:
        return False


class Layers(LayerConnector):
    def __init__(self, calls: list[tuple]) -> None:
        self.calls = calls

    def layer_done(self, request_ids, layer, mark) -> None:
        self.calls.append(("layer", tuple(request_ids), layer, mark))


@pytest.fixture(scope="module")
def llm(ckpt_hv2):
    with LLM(ckpt_hv2, dtype="float32", max_num_batched_tokens=32) as llm:
        yield llm


@pytest.fixture(scope="module")
def recorder(llm):
    r = Recorder()
    llm.engine.use_connector(r)
    return r


def _run(engine) -> dict[str, list[int]]:
    toks: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
    return toks


def test_the_engine_tells_its_connector_each_chunk_then_the_end(llm, recorder):
    e = llm.engine
    prompt = hc.prompts(lens=(70,))[0]
    recorder.calls.clear()
    e.add_request(prompt, GREEDY, "a", transfer="params for a")
    e.add_request(prompt[:20], GREEDY, "b", prefill_only=True)
    _run(e)
    assert recorder.calls[:2] == [("added", "a", "params for a"), ("added", "b", None)]
    a = [c for c in recorder.calls if c[1] == "a"][1:]
    assert a == [("chunk", "a", 0, 32), ("chunk", "a", 32, 64), ("chunk", "a", 64, 70), ("finished", "a", "length")]
    # a prefill-only request is HELD after its prompt, not finished: its memory waits for a transfer
    assert [c for c in recorder.calls if c[1] == "b"][1:] == [("chunk", "b", 0, 20), ("prefilled", "b")]
    e.release("b")
    assert not e.requests


def test_the_last_chunk_of_a_chosen_request_is_handed_over_layer_by_layer(llm, recorder):
    e = llm.engine
    prompt = hc.prompts(lens=(70,), seed=2)[0]
    want = _run_one(e, prompt, "plain")
    recorder.calls.clear()
    recorder.by_layer = {"a"}
    e.executor.worker.use_layer_connector(Layers(recorder.calls))
    try:
        e.add_request(prompt, GREEDY, "a")
        e.add_request(prompt[:20], GREEDY, "b")  # not chosen: no layer call names it
        got = _run(e)
    finally:
        e.executor.worker.use_layer_connector(None)
        recorder.by_layer = set()
    assert got["a"] == want
    layers = [("layer", ("a",), i, None) for i in range(e.cfg.model.num_layers)]  # no device event on the CPU
    a = [c for c in recorder.calls if c[0] == "layer" or c[1] == "a"][1:]
    assert a == [
        ("chunk", "a", 0, 32),
        ("chunk", "a", 32, 64),
        *layers,
        ("chunk", "a", 64, 70),
        ("finished", "a", "length"),
    ]


def test_a_resumed_request_continues_like_the_uninterrupted_one(llm, recorder):
    e = llm.engine
    prompt = hc.prompts(lens=(45,))[0]
    whole = _run_one(e, prompt, "whole")
    recorder.calls.clear()
    for k in (1, 5, 11):
        e.resume_request(prompt, GREEDY, whole[:k], f"resumed{k}")
        got = _run(e)[f"resumed{k}"]
        assert got == whole[k:], k  # only the tokens after those it had; max_tokens counts them all
    assert ("resumed", "resumed5", 5) in recorder.calls
    with pytest.raises(ValueError, match="leave no room"):
        e.resume_request(prompt, GREEDY, [1] * (e.cfg.max_model_len - len(prompt)), "too-long")


def _run_one(e, prompt: list[int], rid: str) -> list[int]:
    e.add_request(prompt, GREEDY, rid)
    return _run(e)[rid]


def test_the_engine_counts_the_pairs_its_prompt_chunks_attend(llm):
    """PrefillCost's work measure: prompts computed in 32-token chunks beside each other count
    each token's positions seen, n (n + 1) / 2 for a whole prompt of n, however it was chunked."""
    from engine.sampling_params import SamplingParams

    e = llm.engine
    tokens, pairs = e.prompt_tokens_computed, e.prompt_pairs_computed
    lens = [70, 45]
    for i, n in enumerate(lens):
        e.add_request(list(range(3, 3 + n)), SamplingParams(max_tokens=1), request_id=f"pairs-{i}")
    _run(e)
    assert e.prompt_tokens_computed - tokens == sum(lens)
    assert e.prompt_pairs_computed - pairs == sum(n * (n + 1) // 2 for n in lens)

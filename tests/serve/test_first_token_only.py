"""A request that ends at its first token (max_tokens 1: classifiers, rerankers, TTFT probes)
through `pdserve up` (one prefill node, one decode node with a single sequence slot): a prefill
node computes it with no decode node, so it neither reserves decode memory nor waits for a
decode slot. While a long stream holds the decode node's only slot and a request that asks for two
tokens waits for it at the head of the router's queue, such requests complete, passing it, their
token transformers' greedy first token, their logprobs transformers' log-softmax, and the decode
node never hears of them; the two-token request gets the slot when the stream ends."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.helpers import hybrid_ckpt as hc
from tests.helpers.serve_harness import Up, flags, log_url, scrape, wait_for

BUSY = 1500  # tokens of the stream that holds the decode slot: still going when the rest are done


@pytest.fixture(scope="module")
def up(ckpt):
    u = Up(
        "--model",
        ckpt,
        *flags(dtype="float32", prefill=1, decode=1, max_num_seqs=1, local_prefill_threshold=0, metrics_port=0),
    )
    yield u
    rc = u.stop()
    assert rc == 0, u.output()


def test_first_token_only_needs_no_decode_node(up, ckpt):
    from client import Client

    hold, *asks = hc.prompts(lens=(12, 40, 57, 33), seed=5)
    greedy = dict(temperature=0.0, ignore_eos=True)
    rurl = log_url(up, r"router metrics at (http://\S+/metrics)")
    with Client(up.address, timeout=180) as c:
        c.wait_ready(timeout=90)
        busy_end: list[float] = []
        stream = iter(c.stream(prompt_token_ids=hold, max_tokens=BUSY, **greedy))
        first = next(stream)
        assert first.decode_node == "decode-0"

        def drain():
            for _ in stream:
                pass
            busy_end.append(time.monotonic())

        t = threading.Thread(target=drain)
        t.start()
        # a request for two tokens waits for the slot at the head of the queue, as long as it
        # takes (the estimate, up to the whole stream, may pass the budget) ...
        twos: list = []
        kw2 = dict(prompt_token_ids=asks[0], max_tokens=2, request_id="two", admission_timeout_s=0, **greedy)
        t2 = threading.Thread(target=lambda: twos.append(c.generate(**kw2)))
        t2.start()
        queued = lambda: scrape(rurl)[("pdserve_router_queue_depth", ())] == 1  # noqa: E731
        wait_for(queued, 30, "the two-token request waiting in the router's queue")
        # ... and the first-token-only requests sent after it pass it
        outs = [
            c.generate(prompt_token_ids=p, max_tokens=1, logprobs=2, request_id=f"one-{i}", **greedy)
            for i, p in enumerate(asks)
        ]
        done = time.monotonic()
        t.join()
        t2.join()
        (two,) = twos
    assert busy_end and done < busy_end[0]  # the decode slot was held all along
    for p, r in zip(asks, outs, strict=True):
        assert r.token_ids == hc.hf_greedy(ckpt, p, 1) and r.finish_reason == "length"
        assert (r.prefill_node, r.decode_node) == ("prefill-0", "")
        with torch.inference_mode():
            ref = torch.log_softmax(hc._hf_model(ckpt)(torch.tensor([p])).logits[0, -1].float(), -1)
        assert abs(r.logprobs[0].logprob - ref[r.token_ids[0]].item()) < 1e-4
        assert [t for t, _ in r.logprobs[0].top] == ref.topk(2).indices.tolist()
    assert two.token_ids == hc.hf_greedy(ckpt, asks[0], 2) and two.decode_node == "decode-0"
    log = up.output()
    assert "add --http-port 8000 for the OpenAI-compatible HTTP API" in log  # no --http-port: says how
    assert "request one-0" in log  # the router's and the prefill node's lines
    assert not [ln for ln in log.splitlines() if "pdserve.decode" in ln and "request one-" in ln]

"""Disaggregated serving through `pdserve up`: prefill and decode nodes at different TP sizes give
transformers' greedy tokens (every prompt through the state transfer), and a prefill node killed
with requests in flight neither hangs a request nor leaks the decode node's memory."""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.helpers import hybrid_ckpt as hc
from tests.helpers.serve_harness import (
    NEW,
    Up,
    check_decode_prefix_reuse,
    check_disaggregated_greedy,
    decode_stats,
    flags,
    node_info,
    node_pid,
    wait_for,
)


# TP 2 -> 1 served in the suite by test_moe_serve.py (Qwen3.5-MoE) and in test_transfer_engine.py; here slow
@pytest.mark.parametrize("a,b", [pytest.param(2, 1, marks=pytest.mark.slow), (1, 2)], ids=["tp2to1", "tp1to2"])
def test_greedy_matches_transformers_across_tp(ckpt, refs, a, b):
    """... and at TP 2 -> 1, a second turn of a conversation moves only its new pages."""
    ps, want = refs
    then = (lambda addr: check_decode_prefix_reuse(ckpt, addr)) if (a, b) == (2, 1) else None
    check_disaggregated_greedy(ckpt, ps, want, a, b, requests=16, then=then)


def test_prefill_node_killed_with_requests_in_flight(ckpt):
    """Two prefill nodes; one is SIGKILLed while long prompts are queued on both. Every request
    completes (elsewhere, with the tokens an undisturbed run gives) or fails UNAVAILABLE, none
    hangs, and the decode node's free pages and slots return to their initial counts."""
    from client import Client, PdserveError
    from tests.helpers import hybrid_ckpt as hc

    ps = hc.prompts(lens=(1500, 1400), seed=11)
    # Without the prefix cache every request computes its whole prompt: with it, the repeated
    # prompts hit the cache and prefill-0 could finish its queue before the kill lands.
    args = ["--model", ckpt, "--dtype", "float32", "--prefill", "2", "--decode", "1", "--max-num-seqs", "32"]
    up = Up(*args, "--no-prefix-caching")
    try:
        d = node_info(up.address, "decode-0")
        initial = decode_stats(d.address).capacity
        with Client(up.address, timeout=90) as c:
            c.wait_ready(timeout=60)
            want = [
                c.generate(prompt_token_ids=p, max_tokens=8, temperature=0.0, ignore_eos=True).token_ids for p in ps
            ]

            def one(i):
                try:
                    r = c.generate(prompt_token_ids=ps[i % 2], max_tokens=8, temperature=0.0, ignore_eos=True)
                    return i, r.token_ids, r.prefill_node
                except PdserveError as e:
                    return i, e.code, e.message

            victim = node_pid(up, "prefill-0")
            with ThreadPoolExecutor(16) as ex:
                futs = [ex.submit(one, i) for i in range(16)]
                wait_for(
                    lambda: node_info(up.address, "prefill-0").capacity.queued_prefill_tokens > 0,
                    20,
                    "prompts queued on prefill-0",
                )
                os.kill(victim, signal.SIGKILL)
                t_kill = time.monotonic()
                results = [f.result(timeout=120) for f in futs]  # none hangs
        done = [r for r in results if isinstance(r[1], list)]
        failed = [r for r in results if not isinstance(r[1], list)]
        for i, toks, where in done:
            assert toks == want[i % 2], f"request {i} (prefill {where or 'local'})"
        for i, code, msg in failed:
            assert code == grpc.StatusCode.UNAVAILABLE, (i, code, msg)
        assert done, results
        assert time.monotonic() - t_kill < 120
        wait_for(lambda: decode_stats(d.address).capacity == initial, 30, "the decode node's memory back")
        assert "prefill on prefill-0 failed" in up.output()
    finally:
        rc = up.stop()
    assert rc == 0, up.output()


def test_prefill_node_killed_mid_stream(ckpt):
    """A long prompt in 32-token chunks streams its pages to the decode node chunk by chunk; its
    one prefill node is SIGKILLed halfway through the prompt. The request fails UNAVAILABLE or
    completes (prefilled again elsewhere) with the undisturbed tokens, and the decode node's
    pages, slots and reservations come back: the partial push leaves nothing behind."""
    from client import Client, PdserveError
    from tests.helpers import hybrid_ckpt as hc
    from tests.helpers.serve_harness import prefill_stats

    prompt = hc.prompts(lens=(2400,), seed=13)[0]
    args = ["--model", ckpt, "--dtype", "float32", "--prefill", "1", "--decode", "1", "--max-num-batched-tokens", "32"]
    up = Up(*args, "--no-prefix-caching")
    try:
        d, p = node_info(up.address, "decode-0"), node_info(up.address, "prefill-0")
        initial = decode_stats(d.address).capacity
        victim = node_pid(up, "prefill-0")
        with Client(up.address, timeout=90) as c, ThreadPoolExecutor(1) as ex:
            c.wait_ready(timeout=60)

            def long():
                try:
                    return c.generate(prompt_token_ids=prompt, max_tokens=4, temperature=0.0, ignore_eos=True)
                except PdserveError as e:
                    return e

            fut = ex.submit(long)
            wait_for(
                lambda: (
                    0 < prefill_stats(p.address).capacity.queued_prefill_tokens <= len(prompt) // 2
                    and decode_stats(d.address).capacity.reserved == 1
                ),
                60,
                "half the prompt prefilled, its pages streaming into the decode node's reservation",
            )
            os.kill(victim, signal.SIGKILL)
            got = fut.result(timeout=120)  # no hang
            assert isinstance(got, PdserveError) and got.code == grpc.StatusCode.UNAVAILABLE or got.token_ids, got
        wait_for(lambda: decode_stats(d.address).capacity == initial, 30, "the decode node's memory back")
    finally:
        rc = up.stop()
    assert rc == 0, up.output()


def test_conditional_disaggregation_same_tokens(ckpt, refs):
    """Prompts shorter than the decode node's --local-prefill-threshold prefill there; the rest go
    through the prefill pool (TP 1 to a decode node at TP 2, whose ranks each keep their shard of
    the landed state for the next turn); transformers' tokens either way."""
    from client import Client

    ps, want = refs
    up = Up("--model", ckpt, "--dtype", "float32", "--local-prefill-threshold", "64", "--decode-tp", "2")
    try:
        assert node_info(up.address, "decode-0").local_prefill_threshold == 64
        with Client(up.address, timeout=120) as c:
            c.wait_ready(timeout=60)
            with ThreadPoolExecutor(len(ps)) as ex:
                greedy = dict(max_tokens=NEW, temperature=0.0, ignore_eos=True)
                outs = list(ex.map(lambda p: c.generate(prompt_token_ids=p, **greedy), ps))
            # a conversation's next turn: its first went through the pool, the decode node keeps
            # the state that landed (at the prompt's end) and the one it finished with (at the
            # reply's end), so a follow-up of a few new tokens is computed there from one of them
            turn1 = next(p for p in ps if len(p) >= 64)
            r1 = c.generate(prompt_token_ids=turn1, **greedy)
            kept = turn1 + r1.token_ids + [5, 6, 7]  # the history keeps the reply
            fresh = turn1 + [9, 10, 11, 12]  # it departs after the prompt (a rewritten reply)
            r2 = [c.generate(prompt_token_ids=t, **greedy) for t in (kept, fresh)]
        for p, w, r in zip(ps, want, outs, strict=True):
            assert r.token_ids == w, f"prompt of {len(p)} tokens"
            assert r.prefill_node == ("" if len(p) < 64 else "prefill-0"), len(p)
            assert (r.transfer_bytes > 0) == (len(p) >= 64)
        assert r1.prefill_node == "prefill-0"
        assert [(r.prefill_node, r.cached_tokens) for r in r2] == [("", len(turn1) + NEW - 1), ("", len(turn1))]
        for t, r in zip((kept, fresh), r2):
            assert r.token_ids == hc.hf_greedy(ckpt, t, NEW)
    finally:
        rc = up.stop()
    assert rc == 0, up.output()
    # the router's line times the reservation on D that precedes the Prefill call, within the TTFT
    logged = [ln for ln in up.lines if re.search(r"pdserve\.router: request \w+: prompt \d+, decode", ln)]
    assert len(logged) >= len(ps), up.output()
    for ln in logged:
        m = re.search(r"prefill (\S+), .* reserve ([\d.]+) ms, ttft ([\d.]+) ms", ln)
        assert (m is not None) == ("prefill prefill-0," in ln), ln
        if m:
            assert 0 < float(m[2]) < float(m[3]), ln


def test_speculative_decode_nodes_match_transformers(ckpt):
    """`up --num-speculative-tokens 3`: every node runs n-gram drafts (prefill and decode must
    agree, it sizes the transferred state pools); the decode node verifies them in its batch and
    the greedy tokens stay transformers'. Its /metrics count the drafts it verified."""
    import re
    import urllib.request

    from client import Client
    from tests.helpers import hybrid_ckpt as hc

    ps = [[5, 6, 7, 8] * 20, [11, 12, 13] * 30 + [14], *hc.prompts(lens=(70,), seed=4)]
    want = [hc.hf_greedy(ckpt, p, 24) for p in ps]
    up = Up("--model", ckpt, *flags(dtype="float32", prefill=1, decode=1, num_speculative_tokens=3, metrics_port=0))
    try:
        with Client(up.address, timeout=120) as c:
            c.wait_ready(timeout=60)
            with ThreadPoolExecutor(3) as ex:
                greedy = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
                outs = list(ex.map(lambda p: c.generate(prompt_token_ids=p, **greedy), ps))
        for p, r, w in zip(ps, outs, want, strict=True):
            assert r.token_ids == w and r.prefill_node == "prefill-0", f"prompt of {len(p)} tokens"
        url = up.find(r"decode node decode-0 metrics at (http://\S+)", 10)
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        val = {
            m.group(1): float(m.group(2))
            for m in re.finditer(r"^pdserve_decode_spec_(\w+)_tokens_total (\S+)$", text, re.M)
        }
        assert val["draft"] > 0 and 0 <= val["accepted"] <= val["draft"]
    finally:
        rc = up.stop()
    assert rc == 0, up.output()

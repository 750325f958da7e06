"""Graceful drain on SIGTERM, with real processes: a node (or the router) told to stop takes
nothing new, finishes what it holds with every token transformers gives, then exits 0; the
router routes around a draining node at once (it is alive, not dead). Also the HTTP statuses
an operator's load balancer sees end to end: 503 with no node, 429 when full, 503 while the
router drains, each with OpenAI's error shape and Retry-After."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from tests.helpers import hybrid_ckpt as hc
from tests.helpers.serve_harness import Proc, Up, flags, node_pid, nodes, wait_for

N = 300  # tokens per long request: they are still decoding when SIGTERM arrives
# The decode-drain test's 6 requests repeat 3 prompts, so the prefill node holds the repeats a
# step for the first ones' prefix snapshots: the first request's 300 tokens (about 3 ms each)
# could end before the last one's first token under load. These last long enough.
N_DECODE = 1000


def _status(address: str, node_id: str):
    return next(n for n in nodes(address) if n.node.node_id == node_id)


def _in_flight_at_drain(proc: Proc, what: str) -> int:
    return int(proc.find(rf"{what} draining: (\d+) in flight"))


@pytest.fixture(scope="module")
def up(ckpt):
    # prompts take 0.2 ms a token to prefill (engine/core.py's test throttle), so prompts are still
    # queued on the prefill node when SIGTERM reaches it, however fast this machine computes them
    env = {"PDSERVE_TEST_PREFILL_DELAY_PER_TOKEN_S": "0.0002"}
    u = Up("--model", ckpt, "--dtype", "float32", "--prefill", "1", "--decode", "2", "--drain-timeout", "120", env=env)
    yield u
    rc = u.stop()
    assert rc == 0, u.output()


def test_decode_node_drains_on_sigterm(up, ckpt):
    from client import Client, GenerateResult

    ps = hc.prompts(lens=(5, 40, 90), seed=21)
    want = [hc.hf_greedy(ckpt, p, 8) for p in ps]
    with Client(up.address, timeout=120) as c:
        c.wait_ready(timeout=60)
        streams = [
            iter(c.stream(prompt_token_ids=ps[i % 3], max_tokens=N_DECODE, temperature=0.0, ignore_eos=True))
            for i in range(6)
        ]
        res = [GenerateResult() for _ in streams]
        for r, it in zip(res, streams, strict=True):
            r.add(next(it))  # decoding now
        on0 = [i for i, r in enumerate(res) if r.decode_node == "decode-0"]
        assert on0 and len(on0) < 6, [r.decode_node for r in res]  # least-loaded spread them over both nodes

        os.kill(node_pid(up, "decode-0"), signal.SIGTERM)
        wait_for(lambda: _status(up.address, "decode-0").node.draining, 10, "the router to see decode-0 draining")
        st = _status(up.address, "decode-0")
        assert st.alive
        assert _in_flight_at_drain(up, "decode node decode-0") == len(on0)

        # new requests go to the other node while decode-0 finishes its own
        for j, p in enumerate(ps):
            r = c.generate(prompt_token_ids=p, max_tokens=8, temperature=0.0, ignore_eos=True)
            assert r.decode_node == "decode-1" and r.token_ids == want[j]

        def finish(i):
            for ch in streams[i]:
                res[i].add(ch)
            return res[i]

        with ThreadPoolExecutor(6) as ex:
            done = list(ex.map(finish, range(6)))
    for i, r in enumerate(done):
        assert len(r.token_ids) == N_DECODE and r.finish_reason == "length", f"request {i} on {r.decode_node}"
        assert not hc.hf_greedy_violations(ckpt, ps[i % 3], r.token_ids), f"request {i} on {r.decode_node}"
    wait_for(lambda: "decode-0 exited with status 0" in up.output(), 60, "decode-0 to exit 0 once drained")
    assert re.search(r"decode node decode-0 drained in [\d.]+ s", up.output()), up.output()
    assert "still in flight end now" not in up.output()


def test_prefill_node_drains_on_sigterm(up, ckpt):
    """Prompts queued on the prefill node are computed and pushed after SIGTERM; the ones the
    router sends after are prefilled elsewhere (here: on the decode node, the only other choice)."""
    from client import Client

    ps = hc.prompts(lens=(1500, 1400), seed=11)
    want = [hc.hf_greedy(ckpt, p, 8) for p in ps]
    with Client(up.address, timeout=120) as c:
        c.wait_ready(timeout=60)

        def one(i):
            return c.generate(prompt_token_ids=ps[i % 2], max_tokens=8, temperature=0.0, ignore_eos=True)

        with ThreadPoolExecutor(8) as ex:
            futs = [ex.submit(one, i) for i in range(8)]
            wait_for(
                lambda: _status(up.address, "prefill-0").node.capacity.queued_prefill_tokens > 0,
                30,
                "prompts queued on prefill-0",
            )
            os.kill(node_pid(up, "prefill-0"), signal.SIGTERM)
            results = [f.result(timeout=180) for f in futs]  # every one completes: none fails
        for i, r in enumerate(results):
            assert r.token_ids == want[i % 2], f"request {i} (prefill {r.prefill_node or 'local'})"
        assert _in_flight_at_drain(up, "prefill node prefill-0") >= 1
        assert any(r.prefill_node == "prefill-0" for r in results)  # accepted before SIGTERM, pushed after
        wait_for(lambda: "prefill-0 exited with status 0" in up.output(), 60, "prefill-0 to exit 0 once drained")
        r = c.generate(prompt_token_ids=ps[0], max_tokens=8, temperature=0.0, ignore_eos=True)
        assert r.token_ids == want[0] and r.prefill_node == ""
    assert re.search(r"prefill node prefill-0 drained in [\d.]+ s", up.output()), up.output()


# ---- the router, and what HTTP clients see ------------------------------------------------------
def _post(url: str, body: dict) -> tuple[int, dict, object]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _error_shape(status: int, body: dict, headers, want_status: int, want_type: str) -> str:
    assert status == want_status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == want_type, body
    # field names are case-insensitive; a refusal at admission says its estimate (whole seconds)
    assert headers.get("Retry-After") == "1" or want_status == 429 and int(headers["Retry-After"]) >= 1, dict(headers)
    return err["message"]


def test_router_http_statuses_and_drain(ckpt, tmp_path):
    from client import Client, GenerateResult, PdserveError

    port_file = tmp_path / "router.port"
    router = Proc(
        "router",
        *flags(port=0, port_file=port_file, model=ckpt, http_port=0, admission_timeout=0.5, drain_timeout=60),
        ready=r"router listening on (\S+)",
    )
    decode = None
    try:
        base = router.find(r"OpenAI-compatible HTTP on (http://\S+/v1)")
        name = Path(ckpt).name
        completion = {"model": name, "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
        # no node registered: 503, not a 404 for the model
        msg = _error_shape(*_post(f"{base}/completions", completion), 503, "service_unavailable")
        assert msg == "no decode node is ready: start one or wait"
        with Client(router.address, timeout=60) as c:
            with pytest.raises(PdserveError) as ei:
                c.generate(prompt_token_ids=[1, 2, 3], max_tokens=2)
            assert ei.value.code == grpc.StatusCode.UNAVAILABLE

            decode = Proc(
                "decode",
                "--model",
                ckpt,
                *flags(dtype="float32", router=router.address, max_num_seqs=1, drain_timeout=60),
                ready=r"decode node \S+ listening on (\S+)",
            )
            c.wait_ready(timeout=60)
            assert _get(base.removesuffix("/v1") + "/health") == (200, {"status": "ok", "decode_nodes": 1})
            # the one state slot taken: 429 at arrival (no room within the 0.5 s budget)
            hold = c.stream(prompt_token_ids=[7, 8, 9], max_tokens=3000, temperature=0.0, ignore_eos=True)
            next(iter(hold))
            t0 = time.monotonic()
            msg = _error_shape(*_post(f"{base}/completions", completion), 429, "rate_limit_error")
            assert "no decode node had room" in msg and time.monotonic() - t0 < 2
            hold.close()

            # SIGTERM the router with a request in flight: it finishes; new ones get 503 / UNAVAILABLE
            s = c.stream(prompt_token_ids=[7, 8, 9], max_tokens=N, temperature=0.0, ignore_eos=True)
            it, res = iter(s), GenerateResult()
            res.add(next(it))
            router.proc.send_signal(signal.SIGTERM)
            router.find(r"(router) draining: 1 in flight")
            with pytest.raises(PdserveError) as ei:
                c.generate(prompt_token_ids=[1, 2, 3], max_tokens=2)
            assert ei.value.code == grpc.StatusCode.UNAVAILABLE and "draining" in ei.value.message
            msg = _error_shape(*_post(f"{base}/completions", completion), 503, "service_unavailable")
            assert "draining" in msg
            assert _get(base.removesuffix("/v1") + "/health") == (503, {"status": "draining"})
            for ch in it:
                res.add(ch)
            assert len(res.token_ids) == N and not hc.hf_greedy_violations(ckpt, [7, 8, 9], res.token_ids)
        assert router.proc.wait(30) == 0, router.output()
        assert re.search(r"router drained in [\d.]+ s", router.output()), router.output()
    finally:
        for p in (decode, router):
            if p is not None:
                p.stop()
    assert decode.proc.returncode == 0, decode.output()


def test_drain_hands_off_a_request_whose_push_was_under_way(ckpt):
    """--drain-handoff: a decode node SIGTERMed while a prompt is still computed for it on the
    prefill node (its reservation made, the push to come) hands that request off too as soon as it
    would start decoding, as it does the streams running at the hand-off, rather than streaming all
    of it while the node waits to exit: the request moves to the other decode node with the first
    token and ends with transformers' tokens; the node exits 0."""
    import threading

    from client import Client
    from proto import pb
    from tests.helpers.serve_harness import decode_stats

    # the prompt takes about 1 s to prefill (the test throttle), well past the 0.1 s hand-off
    env = {"PDSERVE_TEST_PREFILL_DELAY_PER_TOKEN_S": "0.001"}
    u = Up("--model", ckpt, *flags(dtype="float32", prefill=1, decode=2, drain_handoff=0.1, drain_timeout=120), env=env)
    p, n = hc.prompts(lens=(1000,), seed=47)[0], 600
    try:
        decode = {d.node.node_id: d.node.address for d in nodes(u.address) if d.node.kind == pb.NODE_KIND_DECODE}
        pids = {name: node_pid(u, name) for name in decode}
        termed: list[str] = []

        def term_the_reserving_node() -> None:
            def reserving():
                return next((k for k, a in decode.items() if decode_stats(a).capacity.reserved), None)

            victim = wait_for(reserving, 60, "a decode node's reservation")
            os.kill(pids[victim], signal.SIGTERM)
            termed.append(victim)

        t = threading.Thread(target=term_the_reserving_node)
        t.start()
        with Client(u.address, timeout=120) as c:
            c.wait_ready(60)
            r = c.generate(prompt_token_ids=p, max_tokens=n, temperature=0.0, ignore_eos=True)
        t.join(60)
        (victim,) = termed
        assert len(r.token_ids) == n and hc.hf_greedy_violations(ckpt, p, r.token_ids) == []
        wait_for(lambda: f"{victim} exited with status 0" in u.output(), 30, f"{victim} to exit")
        assert f"moved from {victim}(draining@" in u.find(rf"(pdserve.router: request {r.request_id}: prompt .*)")
    finally:
        rc = u.stop()
    assert rc == 0, u.output()

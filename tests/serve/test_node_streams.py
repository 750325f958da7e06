"""A decode node's streams, in process (a real node on the tiny checkpoint, a real router, gRPC and
HTTP on loopback), its engine step slowed by a test hook that sleeps before each step and records
when each token was sampled:

- with --max-num-seqs 256 the node serves 200 Generate streams at once: every stream has its
  first token before any has its last (a fixed pool of 64 handler threads queued the rest behind
  the first 64);
- through the router's streaming HTTP, every token reaches the client in its own event, within
  one step of the step that sampled it (no relay holds a request's tokens back)."""

from __future__ import annotations

import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from proto import pb, rpc

STEP_S = 0.1  # the hook's sleep before each engine step (long: a loaded machine stalls threads for tens of ms)


class _SlowSteps:
    """Wraps an engine's `step`: sleeps STEP_S first, then records (time, request id, new token
    ids) for every output of the step (the loop thread calls it; readers wait for the end)."""

    def __init__(self, engine):
        self.inner = engine.step
        self.sampled: list[tuple[float, str, list[int]]] = []
        engine.step = self

    def __call__(self):
        time.sleep(STEP_S)
        outs = self.inner()
        now = time.monotonic()
        self.sampled.extend((now, o.request_id, list(o.new_token_ids)) for o in outs if o.new_token_ids)
        return outs


def _decode_node(ckpt, router: str | None = None, **kw):
    from decode_node.config import DecodeNodeConfig
    from decode_node.server import serve

    cfg = DecodeNodeConfig(model=str(ckpt), dtype="float32", router=router, heartbeat_interval_s=0.2, **kw)
    node, port = serve("127.0.0.1:0", cfg)
    return node, port, _SlowSteps(node.engine)


def test_a_node_serves_more_streams_than_64_at_once(ckpt):
    import grpc

    node, port, steps = _decode_node(ckpt, max_num_seqs=256, kv_cache_memory="512MiB")
    assert node.handler_threads() >= 256 + 200
    n, new = 200, 12
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    got: dict[int, list[int]] = {}
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = rpc.DecodeNodeStub(ch)

            def one(i: int) -> None:
                sp = pb.SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
                ids: list[int] = []
                for m in stub.Generate(
                    pb.DecodeRequest(request_id=f"s{i}", prompt_token_ids=[1 + i % 7, 2, 3], sampling=sp), timeout=300
                ):
                    if m.token_ids:
                        first.setdefault(i, time.monotonic())
                        ids.extend(m.token_ids)
                last[i] = time.monotonic()
                got[i] = ids

            with ThreadPoolExecutor(n) as ex:
                list(ex.map(one, range(n)))
    finally:
        node.stop(0)
    assert all(len(got[i]) == new for i in range(n))
    assert max(first.values()) < min(last.values()), "some streams started only after others had ended"
    # greedy: the same prompt gives the same tokens, whichever stream carried it
    for i in range(7, n):
        assert got[i] == got[i % 7], i


def test_the_last_message_carries_the_count_of_ends_the_reports_give(ckpt):
    """A request's last message carries the node's count of ended requests with it (node_ended),
    which its capacity reports give from then on (NodeInfo.requests_ended): the router drops a finished
    request's credit only with a report that counts it."""
    import grpc

    from tests.helpers.serve_harness import wait_for

    node, port, _ = _decode_node(ckpt)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = rpc.DecodeNodeStub(ch)
            seqs = []
            for i in range(2):
                sp = pb.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
                msgs = list(
                    stub.Generate(pb.DecodeRequest(request_id=f"e{i}", prompt_token_ids=[1, 2, 3], sampling=sp))
                )
                assert msgs[-1].finish_reason and all(m.node_ended == 0 for m in msgs[:-1])
                seqs.append(msgs[-1].node_ended)
            assert seqs[0] > 0 and seqs[1] == seqs[0] + 1
            ended = lambda: stub.Stats(pb.StatsRequest(), timeout=10).requests_ended  # noqa: E731
            wait_for(lambda: ended() >= seqs[1], 10, "a report counting both ends")
    finally:
        node.stop(0)


@pytest.fixture()
def routed(ckpt):
    from router.server import RouterConfig, serve

    r, port = serve("127.0.0.1:0", RouterConfig(model=str(ckpt), http_port=0, heartbeat_interval_s=0.2))
    node, _, steps = _decode_node(ckpt, router=f"127.0.0.1:{port}")
    from tests.helpers.serve_harness import wait_for

    wait_for(lambda: r.registry.live(pb.NODE_KIND_DECODE), 30, "the decode node registered")
    yield r, steps
    node.stop(0)
    r.stop(0)


@pytest.mark.parametrize("logprobs", [0, None])
def test_each_token_reaches_the_http_client_within_a_step(routed, logprobs):
    """Streamed completions, with `logprobs: 0` (every event names its tokens) and without (an
    event per step even when its text is held back: a partial character, whose bytes the next
    tokens complete)."""
    r, steps = routed
    new = 24
    model = json.loads(_get(r.http_port, "/v1/models"))["data"][0]["id"]
    body = {
        "model": model,
        "prompt": [1, 2, 3, 4],
        "max_tokens": new,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    } | ({} if logprobs is None else {"logprobs": logprobs})
    conn = http.client.HTTPConnection("127.0.0.1", r.http_port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    read_at: list[float] = []  # per token: when the event that carried it was read
    events = 0
    texts: list[str] = []
    buf = b""
    while chunk := resp.read1(65536):
        now = time.monotonic()
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            data = ev.removeprefix(b"data: ")
            if data != b"[DONE]":
                choice = json.loads(data)["choices"][0]
                lp = choice["logprobs"]
                texts.append(choice["text"])
                events += 1
                read_at.extend([now] * (len(lp["tokens"]) if lp else 1))  # one request: a token a step
    conn.close()
    sampled = [t for t, _, ids in steps.sampled for _ in ids]
    assert len(sampled) == len(read_at) == new, (steps.sampled, read_at)
    assert events == new, f"{new} tokens came in {events} events"
    assert "" in texts, "no event held its text back: the case this test is for did not occur"
    late = [round(a - s, 3) for a, s in zip(read_at, sampled, strict=True) if a - s > STEP_S]
    assert not late, f"tokens read more than a step ({STEP_S} s) after they were sampled: {late}"
    lag = sorted(a - s for a, s in zip(read_at, sampled, strict=True))
    print(f"sampled-to-read: median {lag[len(lag) // 2] * 1e3:.1f} ms, max {lag[-1] * 1e3:.1f} ms")


def _get(port: int, path: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def _prefill_node(ckpt, router: str):
    from prefill_node.config import PrefillNodeConfig
    from prefill_node.server import serve

    cfg = PrefillNodeConfig(model=str(ckpt), dtype="float32", router=router, heartbeat_interval_s=0.2)
    node, port = serve("127.0.0.1:0", cfg)
    return node, _SlowSteps(node.engine)


def test_disaggregated_tokens_reach_the_client_within_a_step(ckpt):
    """1 prefill + 1 decode node: the first token (sampled by the prefill node) and every later one
    (the decode node's) reach a gRPC client through the router each in its own chunk, within a
    step of being sampled."""
    from client import Client
    from router.server import RouterConfig, serve
    from tests.helpers.serve_harness import wait_for

    r, port = serve("127.0.0.1:0", RouterConfig(model=str(ckpt), heartbeat_interval_s=0.2))
    addr = f"127.0.0.1:{port}"
    p, psteps = _prefill_node(ckpt, addr)
    d, _, dsteps = _decode_node(ckpt, router=addr)
    new = 16
    try:
        wait_for(
            lambda: len(r.registry.live(pb.NODE_KIND_DECODE)) + len(r.registry.live(pb.NODE_KIND_PREFILL)) == 2,
            30,
            "both nodes registered",
        )
        read_at: list[float] = []
        chunks = 0
        with Client(addr, timeout=120) as c:
            for ch in c.stream(prompt_token_ids=list(range(1, 40)), max_tokens=new, temperature=0.0, ignore_eos=True):
                now = time.monotonic()
                chunks += 1
                read_at.extend([now] * len(ch.token_ids))
                assert not ch.prefill_node or ch.prefill_node == p.cfg.node_id
    finally:
        d.stop(0)
        p.stop(0)
        r.stop(0)
    first = [t for t, _, ids in psteps.sampled for _ in ids]
    later = [t for t, _, ids in dsteps.sampled for _ in ids]
    assert len(first) == 1, psteps.sampled
    sampled = first + later[-(new - 1) :]  # the decode engine's outputs after the first token
    assert len(read_at) == new and chunks == new, (read_at, chunks, dsteps.sampled)
    late = [round(a - s, 3) for a, s in zip(read_at, sampled, strict=True) if a - s > STEP_S]
    assert not late, f"tokens read more than a step ({STEP_S} s) after they were sampled: {late}"

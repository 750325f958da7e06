"""Token streams (DecodeNode.TokenStream, serving/mux.py, router/token_mux.py) on real nodes:

- a node's token stream carries a request's tokens between its first and last messages, one batch
  per step; the last message counts them; the same request without a stream streams on its own call;
- through a router, many concurrent streams get exactly the tokens (and logprobs) the node gives
  each request on its own call, in order, while the router reads far fewer messages than tokens;
- cancelling muxed streams frees the node's pages and slots;
- a decode node SIGKILLed with muxed streams under way: every stream moves and completes with the
  offline engine's tokens (no gap, no duplicate)."""

from __future__ import annotations

import os
import signal
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from proto import pb, rpc
from tests.helpers import hybrid_ckpt as hc
from tests.helpers.serve_harness import Up, log_url, node_pid, scrape, wait_for


def _decode_node(ckpt, router: str | None = None, **kw):
    from decode_node.config import DecodeNodeConfig
    from decode_node.server import serve

    cfg = DecodeNodeConfig(model=str(ckpt), dtype="float32", router=router, heartbeat_interval_s=0.2, **kw)
    return serve("127.0.0.1:0", cfg)


def _sp(new: int, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, **kw)


def test_a_nodes_token_stream_carries_the_tokens_between_first_and_last(ckpt):
    node, port = _decode_node(ckpt)
    new = 20
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = rpc.DecodeNodeStub(ch)
            plain = list(stub.Generate(pb.DecodeRequest(request_id="p", prompt_token_ids=[5, 6, 7], sampling=_sp(new))))
            want = [t for m in plain for t in m.token_ids]
            assert len(want) == new and all(m.muxed_tokens == 0 for m in plain)
            # a stream id the node does not know: the request streams on its own call
            unknown = stub.Generate(
                pb.DecodeRequest(request_id="u", prompt_token_ids=[5, 6, 7], sampling=_sp(new), token_stream="nope")
            )
            assert [t for m in unknown for t in m.token_ids] == want

            sid = uuid.uuid4().hex
            tokens = stub.TokenStream(pb.TokenStreamRequest(stream_id=sid))
            batches: list[pb.TokenBatch] = []

            def read() -> None:
                try:
                    for b in tokens:
                        batches.append(b)
                except grpc.RpcError as e:  # the test cancels it at the end
                    assert e.code() == grpc.StatusCode.CANCELLED

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            wait_for(lambda: node.sinks.get(sid) is not None, 10, "the token stream opened")
            msgs = list(
                stub.Generate(
                    pb.DecodeRequest(
                        request_id="m", prompt_token_ids=[5, 6, 7], sampling=_sp(new, logprobs=1), token_stream=sid
                    )
                )
            )
            first, last = msgs[0], msgs[-1]
            assert first.token_ids and first.prompt_tokens == 3 and first.decode_node == node.cfg.node_id
            assert last.finish_reason == "length" and last.timings.e2e_s > 0 and last.timings.tpot_s > 0

            def muxed() -> list[int]:
                return [t for b in list(batches) for d in b.deltas if d.request_id == "m" for t in d.token_ids]

            wait_for(lambda: len(muxed()) >= last.muxed_tokens, 10, "the stream's batches read")
            assert last.muxed_tokens == len(muxed()) > 0
            assert list(first.token_ids) + muxed() + list(last.token_ids) == want
            # one delta per step: a batch holds this request once
            assert all(sum(d.request_id == "m" for d in b.deltas) <= 1 for b in batches)
            lps = [x.token_id for b in batches for d in b.deltas if d.request_id == "m" for x in d.logprobs]
            assert lps == muxed()
            tokens.cancel()
            reader.join(10)
            wait_for(lambda: node.sinks.get(sid) is None, 10, "the token stream closed on the node")
    finally:
        node.stop(0)


@pytest.fixture()
def routed(ckpt):
    from router.server import RouterConfig, serve

    r, port = serve("127.0.0.1:0", RouterConfig(model=str(ckpt), heartbeat_interval_s=0.2))
    node, nport = _decode_node(ckpt, router=f"127.0.0.1:{port}", max_num_seqs=64)
    wait_for(lambda: r.registry.live(pb.NODE_KIND_DECODE), 30, "the decode node registered")
    yield r, f"127.0.0.1:{port}", node, nport
    node.stop(0)
    r.stop(0)


def test_many_concurrent_streams_are_exact_and_in_order(routed):
    from client import Client

    r, addr, node, nport = routed
    n, new = 32, 24
    prompts = [[1 + i % 11, 2 + i % 5, 3, 4 + i % 3] for i in range(n)]
    with grpc.insecure_channel(f"127.0.0.1:{nport}") as ch:  # each request alone on its own call
        stub = rpc.DecodeNodeStub(ch)
        want = []
        for i, p in enumerate(prompts):
            ms = stub.Generate(
                pb.DecodeRequest(request_id=f"ref{i}", prompt_token_ids=p, sampling=_sp(new, logprobs=0))
            )
            want.append([(t, round(lp.logprob, 4)) for m in ms for t, lp in zip(m.token_ids, m.logprobs, strict=True)])
    with Client(addr, timeout=120) as c:
        c.wait_ready(timeout=30)
        c.generate(prompt_token_ids=[1, 2], max_tokens=2)  # opens the node's token stream
        wait_for(lambda: node.sinks.get(r.registry.live(pb.NODE_KIND_DECODE)[0].mux.stream_id), 10, "stream open")
        before = (r.registry.mux_totals.messages, r.registry.mux_totals.tokens)

        def one(i: int) -> list[tuple[int, float]]:
            out = []
            greedy = dict(max_tokens=new, temperature=0.0, ignore_eos=True, logprobs=0)
            for chunk in c.stream(prompt_token_ids=prompts[i], **greedy):
                out += [(t, round(lp.logprob, 4)) for t, lp in zip(chunk.token_ids, chunk.logprobs, strict=True)]
            return out

        with ThreadPoolExecutor(n) as ex:
            got = list(ex.map(one, range(n)))
    assert [[t for t, _ in g] for g in got] == [[t for t, _ in w] for w in want]
    for g, w in zip(got, want, strict=True):
        assert all(abs(a[1] - b[1]) < 1e-3 for a, b in zip(g, w, strict=True))
    messages = r.registry.mux_totals.messages - before[0]
    tokens = r.registry.mux_totals.tokens - before[1]
    # every token but each request's first and last came on the token stream, many per message
    assert tokens == n * (new - 2), tokens
    assert messages < tokens / 4, (messages, tokens)


def test_cancelled_muxed_streams_free_the_nodes_pages(routed):
    from client import Client

    r, addr, node, _ = routed
    idle = node.loop.snapshot
    with Client(addr, timeout=120) as c:
        c.wait_ready(timeout=30)
        c.generate(prompt_token_ids=[1, 2], max_tokens=2)
        streams = [
            c.stream(prompt_token_ids=[3 + i, 4, 5, 6] * 10, max_tokens=4000, temperature=0.0, ignore_eos=True)
            for i in range(6)
        ]
        its = [iter(s) for s in streams]
        for it in its:
            for _ in range(4):
                next(it)
        assert r.registry.mux_totals.tokens > 0
        wait_for(lambda: node.loop.snapshot.streaming == 6, 10, "six streams on the node")
        assert r.service.client_streams.deltas > 0  # the client's token stream carried them too
        for s in streams:
            s.close()
        assert all(list(it) == [] for it in its)  # a closed stream ends, no error
    wait_for(lambda: node.loop.snapshot.streaming == 0, 20, "the node ended every cancelled stream")
    wait_for(lambda: len(r.service.client_streams) == 0, 10, "the client's token stream closed")

    def back() -> bool:
        c = node.loop.snapshot
        return (c.free_slots, c.free_blocks, c.running) == (idle.free_slots, idle.free_blocks, 0)

    wait_for(back, 20, "the pages and slots back")


def test_a_node_killed_with_muxed_streams_moves_them_exact(ckpt):
    from client import Client
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    ps = hc.prompts(lens=(30, 44, 52, 61, 37, 70), seed=53)
    new = 1000  # streams still running at the kill on a loaded box (300 ended first in one CI run)
    with LLM(ckpt, dtype="float32") as llm:
        want = [
            list(o.output_token_ids)
            for o in llm.generate(
                prompt_token_ids=ps, sampling_params=SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
            )
        ]
    u = Up("--model", ckpt, "--dtype", "float32", "--decode", "2", "--prefill", "0", "--metrics-port", "0")
    try:
        url = log_url(u, r"router metrics at (http://\S+)")
        with Client(u.address, timeout=120) as c:
            c.wait_ready(timeout=60)
            for _ in range(4):  # opens both nodes' token streams
                c.generate(prompt_token_ids=[1, 2, 3], max_tokens=3)
            its = [iter(c.stream(prompt_token_ids=p, max_tokens=new, temperature=0.0, ignore_eos=True)) for p in ps]
            got = [next(it) for it in its]
            toks = [list(g.token_ids) for g in got]
            for i, it in enumerate(its):  # a few muxed tokens each before the kill
                while len(toks[i]) < 8:
                    toks[i] += next(it).token_ids
            nodes_of = [g.decode_node for g in got]
            victim = max(set(nodes_of), key=nodes_of.count)
            os.kill(node_pid(u, victim), signal.SIGKILL)
            for i, it in enumerate(its):
                for ch in it:
                    toks[i] += ch.token_ids
        assert toks == want
        m = scrape(url)
        assert m.get(("pdserve_router_token_stream_tokens_total", ()), 0) > 0, m
        assert sum(v for k, v in m.items() if k[0] == "pdserve_router_migrations_total") >= 1
        assert f"moved from {victim}(" in "".join(u.lines)
    finally:
        u.stop()


def test_async_streams_left_early_or_dropped_cancel_their_requests(routed):
    """AsyncClient as Client: a `break` out of `async for`, or a stream dropped after a chunk (no
    close, no `async with`), cancels the request; it does not decode on to max_tokens."""
    import asyncio
    import gc

    from client import AsyncClient

    r, addr, node, _ = routed
    long = dict(max_tokens=100_000, temperature=0.0, ignore_eos=True)  # cut to what the context leaves

    def idle() -> bool:
        return node.loop.snapshot.running == 0

    async def run() -> None:
        async with AsyncClient(addr, timeout=120) as c:
            await c.wait_ready(timeout=30)
            async for _ in c.stream(prompt_token_ids=[3, 4, 5, 6] * 10, **long):
                break
            await asyncio.to_thread(wait_for, idle, 10, "the request cancelled after a break")
            s = c.stream(prompt_token_ids=[7, 4, 5, 6] * 10, **long)
            it = s.__aiter__()
            await it.__anext__()
            assert node.loop.snapshot.running == 1
            del s, it
            gc.collect()
            await asyncio.to_thread(wait_for, idle, 10, "the request cancelled with its stream dropped")

    asyncio.run(run())

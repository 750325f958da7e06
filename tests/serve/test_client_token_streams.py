"""Clients' token streams (Generation.TokenStream: router/client_streams.py, client/mux.py) on a real
router and decode node:

- on the wire: a call naming the client's stream gets its first and last messages, the chunks
  between come on the stream with their text, then the request's `last` delta; the last message
  counts the tokens; a stream id the router does not know, or one opened on another connection,
  leaves every chunk on the call;
- through the SDK (Client and AsyncClient), concurrent streams with token streams on get exactly
  what they get with them off (tokens, text, logprobs, stop strings), while the router sends far
  fewer messages than chunks;
- a token stream the router ends mid-request: the rest comes on the calls, exact, and the next
  request opens a new stream.
Cancelled streams (the node's pages back, the client's token stream closed): test_token_mux.py."""

from __future__ import annotations

import contextlib
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client import generate_latest

from proto import pb, rpc
from tests.helpers.serve_harness import wait_for


@pytest.fixture()
def routed(ckpt):
    with _routed(ckpt) as r:
        yield r


@contextlib.contextmanager
def _routed(ckpt):
    from decode_node.config import DecodeNodeConfig
    from decode_node.server import serve as serve_node
    from router.server import RouterConfig, serve

    r, port = serve("127.0.0.1:0", RouterConfig(model=str(ckpt), heartbeat_interval_s=0.2))
    cfg = DecodeNodeConfig(
        model=str(ckpt), dtype="float32", router=f"127.0.0.1:{port}", heartbeat_interval_s=0.2, max_num_seqs=64
    )
    node, _ = serve_node("127.0.0.1:0", cfg)
    wait_for(lambda: r.registry.live(pb.NODE_KIND_DECODE), 30, "the decode node registered")
    try:
        yield r, f"127.0.0.1:{port}", node
    finally:
        node.stop(0)
        r.stop(0)


def _sp(new: int, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, **kw)


def _read(call, into: list, errors: list) -> threading.Thread:
    def run() -> None:
        try:
            into.extend(call)
        except grpc.RpcError as e:
            errors.append(e.code())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_call_naming_the_clients_stream_gets_the_middle_chunks_there(routed):
    r, addr, _ = routed
    new = 16
    streams = r.service.client_streams
    # a connection of its own (channels of one process share one by default)
    own = [("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(addr) as ch, grpc.insecure_channel(addr, options=own) as other:
        stub = rpc.GenerationStub(ch)
        plain = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=_sp(new, logprobs=1))))
        want = [t for m in plain for t in m.token_ids]
        want_text = "".join(m.text for m in plain)
        assert len(want) == new and want_text and not any(m.token_stream for m in plain)

        sid = uuid.uuid4().hex
        batches: list[pb.TokenBatch] = []
        errors: list = []
        tokens = stub.TokenStream(pb.TokenStreamRequest(stream_id=sid))
        reader = _read(tokens, batches, errors)
        wait_for(lambda: len(streams) == 1, 10, "the token stream opened")

        # the same id named from another connection: not its stream, every chunk on the call
        foreign = list(
            rpc.GenerationStub(other).Generate(
                pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=_sp(new), token_stream=sid)
            )
        )
        assert [t for m in foreign for t in m.token_ids] == want and not foreign[0].token_stream
        unknown = list(
            stub.Generate(pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=_sp(new), token_stream="nope"))
        )
        assert [t for m in unknown for t in m.token_ids] == want and not unknown[0].token_stream

        msgs = list(
            stub.Generate(
                pb.GenerateRequest(
                    request_id="m", prompt_token_ids=[5, 6, 7], sampling=_sp(new, logprobs=1), token_stream=sid
                )
            )
        )
        first, last = msgs[0], msgs[-1]
        assert len(msgs) == 2 and first.token_stream and first.token_ids and first.prompt_tokens == 3
        assert last.finish_reason == "length" and last.timings.e2e_s > 0

        def deltas() -> list[pb.TokenDelta]:
            return [d for b in list(batches) for d in b.deltas if d.request_id == "m"]

        wait_for(lambda: any(d.last for d in deltas()), 10, "the request's last delta")
        ds = deltas()
        assert ds[-1].last and not ds[-1].token_ids and sum(d.last for d in ds) == 1
        muxed = [t for d in ds for t in d.token_ids]
        assert last.muxed_tokens == len(muxed) > 0
        assert list(first.token_ids) + muxed + list(last.token_ids) == want
        assert first.text + "".join(d.text for d in ds) + last.text == want_text
        assert [x.token_id for d in ds for x in d.logprobs] == muxed
        tokens.cancel()
        reader.join(10)
        assert errors == [grpc.StatusCode.CANCELLED]
        wait_for(lambda: len(streams) == 0, 10, "the token stream closed on the router")


def _run(addr: str, prompts, token_streams: bool, **sampling):
    from client import Client

    with Client(addr, timeout=120, token_streams=token_streams) as c:
        c.wait_ready(timeout=30)

        def one(p):
            toks, text, lps, reasons = [], "", [], []
            for chunk in c.stream(prompt_token_ids=p, **sampling):
                toks += chunk.token_ids
                text += chunk.text
                lps += [round(lp.logprob, 4) for lp in chunk.logprobs]
                reasons.append(chunk.finish_reason)
            return toks, text, lps, reasons[-1]

        with ThreadPoolExecutor(len(prompts)) as ex:
            return list(ex.map(one, prompts))


def test_sdk_streams_are_the_same_with_token_streams_and_batched(routed):
    r, addr, _ = routed
    prompts = [[1 + i % 11, 2 + i % 5, 3, 4 + i % 3] for i in range(24)]
    greedy = dict(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    want = _run(addr, prompts, False, **greedy)
    before = (r.service.client_streams.messages, r.service.client_streams.deltas)
    got = _run(addr, prompts, True, **greedy)
    assert [g[:2] for g in got] == [w[:2] for w in want]
    for g, w in zip(got, want, strict=True):
        assert g[3] == w[3] == "length" and all(abs(a - b) < 1e-3 for a, b in zip(g[2], w[2], strict=True))
    messages = r.service.client_streams.messages - before[0]
    chunks = r.service.client_streams.deltas - before[1]
    assert chunks >= len(prompts) * 10  # most chunks came on the stream ...
    assert messages * 3 < chunks  # ... several requests' to a message
    text = generate_latest(r.service.metrics.registry).decode()
    assert f"pdserve_router_client_token_stream_chunks_total {float(r.service.client_streams.deltas)}" in text

    # a stop string inside the output: cut at the same place, finish reason "stop"
    stops = [w[1][len(w[1]) // 2 : len(w[1]) // 2 + 3] for w in want[:6]]
    cases = [(on, p, s) for on in (False, True) for p, s in zip(prompts[:6], stops, strict=True)]
    cut = [_run(addr, [p], on, max_tokens=24, temperature=0.0, ignore_eos=True, stop=[s]) for on, p, s in cases]
    assert [c[0][1] for c in cut[6:]] == [c[0][1] for c in cut[:6]]
    assert all(c[0][3] == "stop" for c in cut)


def test_a_stream_the_router_ends_mid_request_leaves_the_rest_on_the_calls(routed):
    from client import Client

    r, addr, node = routed
    prompts = [[7, 8 + i, 9, 10] for i in range(4)]
    greedy = dict(max_tokens=200, temperature=0.0, ignore_eos=True)
    want = _run(addr, prompts, False, **greedy)
    streams = r.service.client_streams
    with Client(addr, timeout=120) as c:
        c.wait_ready(timeout=30)
        its = [iter(c.stream(prompt_token_ids=p, **greedy)) for p in prompts]
        got = [list(next(it).token_ids) for it in its]
        for i, it in enumerate(its):
            for _ in range(3):
                got[i] += next(it).token_ids
        assert len(streams) == 1
        r.loop.call_soon_threadsafe(streams.close_all)
        for i, it in enumerate(its):
            for chunk in it:
                got[i] += chunk.token_ids
        assert got == [w[0] for w in want]
        # the next request opens a new token stream
        again = c.generate(prompt_token_ids=prompts[0], **greedy)
        assert again.token_ids == want[0][0] and len(streams) == 1


def test_async_client_streams_are_the_same_with_token_streams(routed):
    import asyncio

    from client import AsyncClient

    r, addr, _ = routed
    prompts = [[2 + i % 7, 3, 5 + i % 4, 1] for i in range(12)]
    greedy = dict(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=0)
    want = _run(addr, prompts, False, **greedy)

    async def run() -> list:
        async with AsyncClient(addr, timeout=120) as c:
            await c.wait_ready(timeout=30)

            async def one(p):
                toks, text = [], ""
                async for chunk in c.stream(prompt_token_ids=p, **greedy):
                    toks += chunk.token_ids
                    text += chunk.text
                return toks, text

            return await asyncio.gather(*(one(p) for p in prompts))

    before = r.service.client_streams.deltas
    got = asyncio.run(run())
    assert [list(g) for g in got] == [list(w[:2]) for w in want]
    assert r.service.client_streams.deltas - before >= len(prompts) * 10  # they came on its stream
    wait_for(lambda: len(r.service.client_streams) == 0, 10, "the client's token stream closed")


def test_a_router_without_token_streams_gets_every_chunk_on_the_calls(ckpt, monkeypatch):
    """An older router (no Generation.TokenStream: the generated base answers UNIMPLEMENTED): the
    SDK streams each request on its own call, exact, and stops asking for a stream."""
    from client import Client
    from router.grpc_api import GenerationApi

    monkeypatch.delattr(GenerationApi, "TokenStream")
    prompts = [[4 + i, 5, 6] for i in range(6)]
    greedy = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    with _routed(ckpt) as (r, addr, _), Client(addr, timeout=120) as c:
        want = _run(addr, prompts, False, **greedy)
        c.wait_ready(timeout=30)
        first = c.generate(prompt_token_ids=prompts[0], **greedy)
        streams = c._streams
        assert streams is not None
        wait_for(lambda: streams._open[0].unsupported, 10, "the stream refused")
        tried = streams._open[0]
        with ThreadPoolExecutor(len(prompts)) as ex:
            got = list(ex.map(lambda p: c.generate(prompt_token_ids=p, **greedy).token_ids, prompts))
        assert [first.token_ids, *got] == [want[0][0], *[w[0] for w in want]]
        assert streams._open[0] is tried  # not asked again
        assert r.service.client_streams.deltas == 0

"""router/token_mux.py on its own, with a fake Generate call and deltas put by hand: the order
`merged` relays a request's messages in (the call's first message before any delta, the call's
later messages only once the deltas they count are in, a call error after the messages before
it, a broken stream or a cancelled call at once, a stream its node ended leaving each call its own
end), and the demultiplexing of a node's batches."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from proto import pb
from router.token_mux import MuxTotals, StreamBroken, TokenMux, merged


class _Feed:
    """A Generate call (messages) or a TokenStream call (batches) whose items, or an error, the
    test releases one by one; None ends it."""

    def __init__(self) -> None:
        self.q: asyncio.Queue = asyncio.Queue()

    def __aiter__(self):
        return self

    async def __anext__(self):
        m = await self.q.get()
        if m is None:
            raise StopAsyncIteration
        if isinstance(m, BaseException):
            raise m
        return m


_Call = _Feed


class _Err(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "handed off"


class _Stub:
    def __init__(self) -> None:
        self.calls: list[_Feed] = []

    def TokenStream(self, req):
        self.calls.append(_Feed())
        return self.calls[-1]


def _delta(rid: str, *ids: int) -> pb.TokenDelta:
    return pb.TokenDelta(request_id=rid, token_ids=list(ids))


async def _collect(gen, out: list):
    try:
        async for m in gen:
            out.append((list(m.token_ids), m.finish_reason))
    except BaseException as e:  # noqa: BLE001  # the test checks what ended it
        out.append(e)


async def _one_request():
    """A node's mux with request r1 routed on it, its call, what it relays, the relaying task."""
    stub = _Stub()
    mux = TokenMux("d0", lambda: stub)
    call, out = _Call(), []
    task = asyncio.create_task(_collect(merged(call, mux.route("r1")), out))
    await _settle()
    return stub, mux, call, out, task


async def _three_requests():
    """A node's mux with r0..r2 routed on it, each call's first message ([1]) sent: the stub, the
    mux, the routes, the calls, what each relays, the relaying tasks."""
    stub = _Stub()
    mux = TokenMux("d0", lambda: stub)
    routes = [mux.route(f"r{i}") for i in range(3)]
    outs: list[list] = [[], [], []]
    calls = [_Call() for _ in routes]
    tasks = [asyncio.create_task(_collect(merged(c, r), o)) for c, r, o in zip(calls, routes, outs, strict=True)]
    await _settle()
    for c in calls:
        c.q.put_nowait(pb.GenerateResponse(token_ids=[1]))
    return stub, mux, routes, calls, outs, tasks


async def _settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_deltas_wait_for_the_first_message_and_the_last_waits_for_its_deltas():
    async def go():
        stub = _Stub()
        mux = TokenMux("d0", lambda: stub, MuxTotals())
        route = mux.route("r1")
        assert route is not None and route.stream_id
        call, out = _Call(), []
        task = asyncio.create_task(_collect(merged(call, route), out))
        await _settle()
        batches = stub.calls[0]
        # a step's delta overtakes the call's first message: held until that message is relayed
        batches.q.put_nowait(pb.TokenBatch(deltas=[_delta("r1", 2), _delta("other", 9)]))
        await _settle()
        assert out == []
        call.q.put_nowait(pb.GenerateResponse(token_ids=[1], prompt_tokens=3))
        await _settle()
        assert out == [([1], ""), ([2], "")]
        # the last message counts 3 muxed tokens: relayed once the 2nd and 3rd arrive
        call.q.put_nowait(pb.GenerateResponse(token_ids=[5], finish_reason="length", muxed_tokens=3))
        call.q.put_nowait(None)
        await _settle()
        assert out[-1] == ([2], "")
        batches.q.put_nowait(pb.TokenBatch(deltas=[_delta("r1", 3, 4)]))  # MTP: two tokens in one step
        await asyncio.wait_for(task, 5)
        assert out == [([1], ""), ([2], ""), ([3, 4], ""), ([5], "length")]
        assert mux.routed == 0 and mux.totals.messages == 2 and mux.totals.tokens == 4
        batches.q.put_nowait(None)
        await _settle()

    asyncio.run(go())


def test_a_call_error_comes_after_the_tokens_before_it():
    """The drain's hand-off: the message before the error counts the muxed tokens; they are
    relayed, then the error raised (the request moves with every token the node sent)."""

    async def go():
        stub, mux, call, out, task = await _one_request()
        call.q.put_nowait(pb.GenerateResponse(token_ids=[1]))
        call.q.put_nowait(pb.GenerateResponse(token_ids=[], muxed_tokens=2))
        call.q.put_nowait(_Err())
        await _settle()
        assert out == [([1], "")]
        stub.calls[0].q.put_nowait(pb.TokenBatch(deltas=[_delta("r1", 2)]))
        stub.calls[0].q.put_nowait(pb.TokenBatch(deltas=[_delta("r1", 3)]))
        await asyncio.wait_for(task, 5)
        assert out[:-1] == [([1], ""), ([2], ""), ([3], "")]  # the count alone is not relayed
        assert isinstance(out[-1], _Err)
        stub.calls[0].q.put_nowait(None)
        await _settle()

    asyncio.run(go())


def test_a_broken_stream_fails_its_requests_at_once_and_the_next_route_reopens_it():
    async def go():
        stub, mux, routes, calls, outs, tasks = await _three_requests()
        await _settle()
        first_id = routes[0].stream_id
        stub.calls[0].q.put_nowait(_Err())  # the node died
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        for o in outs:
            assert o[0] == ([1], "") and isinstance(o[-1], StreamBroken)
            assert o[-1].code() == grpc.StatusCode.UNAVAILABLE
        assert mux.totals.broken == 1
        again = mux.route("r9")
        await _settle()
        assert again is not None and again.stream_id != first_id and len(stub.calls) == 2
        again.close()
        mux.close()
        await _settle()

    asyncio.run(go())


def test_a_stream_its_node_ends_leaves_each_call_its_own_end(caplog):
    """A stopping node closes its token stream (no error) before or after its calls end: a call's
    own error (a drain's hand-off) still ends its request, one that finished normally still
    finishes, and only a call whose counted tokens never came fails as the stream's loss. That end
    is no broken stream: logged at INFO, not counted broken (every clean `pdserve up` stop with a
    stream running said WARNING 'token stream broke')."""

    async def go():
        stub, mux, routes, calls, outs, tasks = await _three_requests()
        stub.calls[0].q.put_nowait(pb.TokenBatch(deltas=[_delta("r0", 2), _delta("r1", 2), _delta("r2", 2)]))
        await _settle()
        stub.calls[0].q.put_nowait(None)  # the node stops: its stream ends cleanly, first
        await _settle()
        calls[0].q.put_nowait(pb.GenerateResponse(token_ids=[], muxed_tokens=1))
        calls[0].q.put_nowait(_Err())  # handed off
        calls[1].q.put_nowait(pb.GenerateResponse(token_ids=[3], finish_reason="length", muxed_tokens=1))
        calls[1].q.put_nowait(None)
        calls[2].q.put_nowait(pb.GenerateResponse(token_ids=[], finish_reason="length", muxed_tokens=2))
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert outs[0][:-1] == [([1], ""), ([2], "")] and isinstance(outs[0][-1], _Err)
        assert outs[1] == [([1], ""), ([2], ""), ([3], "length")]
        assert outs[2][:-1] == [([1], ""), ([2], "")] and isinstance(outs[2][-1], StreamBroken)
        assert mux.totals.broken == 0
        mux.close()
        await _settle()

    import logging

    with caplog.at_level(logging.INFO, logger="pdserve.router"):
        asyncio.run(go())
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "token stream" in r.getMessage()]
    assert said == [(logging.INFO, "decode node d0: token stream ended with 3 requests on it")], said


def test_a_node_without_token_streams_is_not_asked_again():
    class _Unimplemented(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNIMPLEMENTED

        def details(self):
            return "Method not found!"

    async def go():
        stub, mux, call, out, task = await _one_request()
        stub.calls[0].q.put_nowait(_Unimplemented())
        await _settle()
        # the node streamed the request on its own call (it did not know the stream): unaffected
        call.q.put_nowait(pb.GenerateResponse(token_ids=[1]))
        call.q.put_nowait(pb.GenerateResponse(token_ids=[2], finish_reason="stop"))
        call.q.put_nowait(None)
        await asyncio.wait_for(task, 5)
        assert out == [([1], ""), ([2], "stop")]
        assert mux.unsupported and mux.route("r2") is None and len(stub.calls) == 1

    asyncio.run(go())


def test_a_cancelled_call_raises_at_once():
    """NodeWatch cancels the call of a node declared dead: no waiting for tokens it never sends."""

    async def go():
        stub, mux, call, out, task = await _one_request()
        call.q.put_nowait(pb.GenerateResponse(token_ids=[1]))
        call.q.put_nowait(pb.GenerateResponse(token_ids=[7], finish_reason="stop", muxed_tokens=5))
        call.q.put_nowait(asyncio.CancelledError())
        await asyncio.wait_for(task, 5)
        assert out[0] == ([1], "") and isinstance(out[-1], asyncio.CancelledError)
        mux.close()
        await _settle()

    asyncio.run(go())


@pytest.mark.parametrize("n", [1, 3])
def test_many_routes_get_their_own_tokens_in_order(n):
    async def go():
        stub = _Stub()
        mux = TokenMux("d0", lambda: stub)
        rids = [f"r{i}" for i in range(40)]
        routes = [mux.route(r) for r in rids]
        calls = [_Call() for _ in rids]
        outs: list[list] = [[] for _ in rids]
        tasks = [asyncio.create_task(_collect(merged(c, r), o)) for c, r, o in zip(calls, routes, outs, strict=True)]
        await _settle()
        for i, c in enumerate(calls):
            c.q.put_nowait(pb.GenerateResponse(token_ids=[i * 1000]))
        steps = 30
        for s in range(1, steps + 1):  # one batch per step, every request's n tokens
            stub.calls[0].q.put_nowait(
                pb.TokenBatch(deltas=[_delta(r, *[i * 1000 + s * n + k for k in range(n)]) for i, r in enumerate(rids)])
            )
        for c in calls:
            c.q.put_nowait(pb.GenerateResponse(finish_reason="length", muxed_tokens=steps * n))
            c.q.put_nowait(None)
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        for i, o in enumerate(outs):
            toks = [t for ids, _ in o for t in ids]
            assert toks == [i * 1000] + [i * 1000 + s * n + k for s in range(1, steps + 1) for k in range(n)]
            assert o[-1] == ([], "length")
        assert mux.routed == 0
        mux.close()
        await _settle()

    asyncio.run(go())

"""`POST /v1/messages` and `POST /v1/messages/count_tokens`, Anthropic's Messages API, for the
coding agents and SDKs that speak it: the body becomes a chat request
(router/anthropic_request.py) served by the chat path as one choice; its deltas become content
blocks (router/anthropic_output.py). Streamed: `message_start` once the first tokens are in, each
block's events, `message_delta` (stop_reason, usage) and `message_stop`. Errors take Anthropic's
shape (`{"type": "error", "error": {"type", "message"}}`): before the first token as an HTTP
status, after it as an `error` event. `x-api-key` is accepted wherever `Authorization: Bearer`
is (router/auth.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from router.anthropic_output import Blocks, body, message, stop_reason, usage
from router.anthropic_request import MessagesRequest, to_chat
from router.errors import Abort
from router.openai_api import OpenAIFront, _Gone, _json, _sse_event, _until_disconnect
from router.openai_choices import Choice, Job
from router.openai_models import ApiError, parse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def _error_body(e: ApiError) -> dict[str, Any]:
    msg = f"{e.param}: {e.message}" if e.param and e.param not in e.message else e.message
    return {"type": "error", "error": {"type": _TYPES.get(e.status, "api_error"), "message": msg}}


def _refused(e: ApiError | Abort) -> Response:
    """An error before the answer began, as Anthropic's clients read it."""
    err = e if isinstance(e, ApiError) else ApiError.from_abort(e)
    return _json(err.status, _error_body(err), err.retry_after_s)


class _Turn:
    """One choice read as an Anthropic message: its blocks, its stop sequence and usage."""

    def __init__(self, front: OpenAIFront, job: Job):
        self.choice, self.blocks, self.stop = Choice(job, 0, front.tok), Blocks(), ""
        self.mid, self.model = "msg_" + job.id, job.model

    def feed(self, c) -> list[dict[str, Any]]:
        self.stop = c.stop or self.stop
        d = self.choice.delta(c)
        return self.blocks.feed(d["delta"]) if d is not None else []

    def usage(self) -> dict[str, int]:
        ch = self.choice
        return usage(ch.prompt_tokens, ch.cached_tokens, ch.n)

    def reason(self) -> str:
        return stop_reason(self.choice._finish(self.choice.finish), self.stop)

    def whole(self) -> dict[str, Any]:
        return message(self.mid, self.model, self.blocks.blocks, self.reason(), self.stop, self.usage())


def register(app: FastAPI, front: OpenAIFront, limit: int, hints: Callable[[Request], None]) -> None:
    """The two routes on `app`; `hints` sets the request's admission hints (its API key)."""
    from router.http_limits import read_json  # noqa: PLC0415 (beside the other routes' reader)

    async def chat_of(request: Request):
        hints(request)
        req = parse(MessagesRequest, await read_json(request, limit))
        assert isinstance(req, MessagesRequest)
        return req, to_chat(req)

    @app.post("/v1/messages")
    async def messages(request: Request):
        try:
            req, chat = await chat_of(request)
            if req.max_tokens is None:
                raise ApiError(400, "'max_tokens' is required", param="max_tokens")
            job = await front.job(chat)
            if req.stream:
                return await _stream(front, job, request)
            return await _until_disconnect(request, _whole(front, job))
        except _Gone:
            return Response(status_code=499)
        except (ApiError, Abort) as e:
            return _refused(e)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        try:
            _, chat = await chat_of(request)
            front.model(chat.model)
            if front.tok is None:
                raise ApiError(400, "this router has no tokenizer (the checkpoint has no tokenizer.json)")
            prep = await front.render(chat)
            ids = await front.service.encode(prep.prompt)
            if prep.images:  # each image's placeholder becomes its tokens (a size-dependent count)
                ids, _ = front.service.images.expand(ids, await front.service.images.prepare(prep.images))
            return _json(200, {"input_tokens": len(ids)})
        except (ApiError, Abort) as e:
            return _refused(e)


async def _whole(front: OpenAIFront, job: Job) -> Response:
    turn = _Turn(front, job)
    async with aclosing(front.events(job)) as ev:
        async for _, c in ev:
            turn.feed(c)
    turn.blocks.close()
    return Response(body(turn.whole()), 200, media_type="application/json")


async def _stream(front: OpenAIFront, job: Job, request: Request) -> Response:
    ev = await front.opened(job, request)
    turn = _Turn(front, job)

    async def body() -> AsyncIterator[bytes]:
        started = False

        def start() -> bytes:
            use = dict(turn.usage(), output_tokens=0)
            return _sse_event({"type": "message_start", "message": message(turn.mid, turn.model, [], None, "", use)})

        try:
            async for _, c in ev:
                out = turn.feed(c)
                if not started:
                    started = True
                    yield start()
                for e in out:
                    yield _sse_event(e)
            if not started:
                yield start()
            for e in turn.blocks.close():
                yield _sse_event(e)
            delta = {"stop_reason": turn.reason(), "stop_sequence": turn.stop or None}
            yield _sse_event({"type": "message_delta", "delta": delta, "usage": turn.usage()})
            yield _sse_event({"type": "message_stop"})
        except Abort as a:  # mid-stream: an error event, then the end
            yield _sse_event(_error_body(ApiError.from_abort(a)))
        finally:
            await ev.aclose()

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

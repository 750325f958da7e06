"""`POST /v1/responses`, stateless: the body becomes a chat request (router/responses_request.py)
served by the chat path as one choice; its deltas become Responses items and events
(router/responses_output.py). Streamed: `response.created`, `response.in_progress`, each item's
events, then `response.completed` (or `response.incomplete` at max_output_tokens); an error
before the first token is an HTTP status, after it an `error` event."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from router.errors import Abort
from router.openai_api import OpenAIFront, _Gone, _json, _sse_event, _until_disconnect
from router.openai_choices import Choice, Job, usage
from router.openai_models import ApiError, parse
from router.responses_output import ResponseItems, response
from router.responses_request import ResponsesRequest, to_chat


def _status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


async def respond(front: OpenAIFront, body: Any, request: Request) -> Response:
    req = parse(ResponsesRequest, body)
    assert isinstance(req, ResponsesRequest)
    job = await front.job(to_chat(req))
    rid = "resp_" + job.id
    try:
        if req.stream:
            return await _stream(front, job, req, rid, request)
        return await _until_disconnect(request, _whole(front, job, req, rid))
    except _Gone:
        return Response(status_code=499)


async def _whole(front: OpenAIFront, job: Job, req: ResponsesRequest, rid: str) -> Response:
    choice, items = Choice(job, 0, front.tok), ResponseItems(req.carries_reasoning)
    async with aclosing(front.events(job)) as ev:
        async for _, c in ev:
            d = choice.delta(c)
            if d is not None:
                items.feed(d["delta"])
    items.close(_status(choice.finish))
    out = response(rid, job.model, req, items.items, _status(choice.finish), choice.finish, usage([choice]))
    return _json(200, out)


async def _stream(front: OpenAIFront, job: Job, req: ResponsesRequest, rid: str, request: Request) -> Response:
    ev = await front.opened(job, request)
    choice, items = Choice(job, 0, front.tok), ResponseItems(req.carries_reasoning)

    async def body() -> AsyncIterator[bytes]:
        head = response(rid, job.model, req, [], "in_progress", None, None)
        yield _sse_event(items.event("response.created", response=head))
        yield _sse_event(items.event("response.in_progress", response=head))
        try:
            async for _, c in ev:
                d = choice.delta(c)
                for e in items.feed(d["delta"]) if d is not None else ():
                    yield _sse_event(e)
            status = _status(choice.finish)
            for e in items.close(status):
                yield _sse_event(e)
            done = response(rid, job.model, req, items.items, status, choice.finish, usage([choice]))
            yield _sse_event(items.event(f"response.{status}", response=done))
        except Abort as a:  # mid-stream: an error event, then the end
            err = ApiError.from_status(a.code, a.msg)
            yield _sse_event(items.event("error", code=err.code, message=err.message, param=err.param))
        finally:
            await ev.aclose()

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

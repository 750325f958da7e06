"""The Responses routes: `POST /v1/responses` (the body becomes a chat request,
router/responses_request.py, served by the chat path as one choice; its deltas become Responses
items and events, router/responses_output.py) and, for responses kept with `store`
(router/responses_store.py), `GET` / `DELETE /v1/responses/{id}` and `GET
/v1/responses/{id}/input_items`. Streamed: `response.created`, `response.in_progress`, each
item's events, then `response.completed` (or `response.incomplete` at max_output_tokens); an
error before the first token is an HTTP status, after it an `error` event. A response is stored
once it is complete, not when it failed or its client went away. `truncation: "auto"` drops the
conversation's oldest turns until its prompt and max_output_tokens fit the context."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from router.errors import Abort
from router.openai_api import OpenAIFront, _Gone, _json, _sse_event, _until_disconnect
from router.openai_choices import Choice, Job, usage
from router.openai_models import ApiError, parse
from router.responses_output import ResponseItems, response
from router.responses_request import ResponsesRequest, to_chat, turn_starts
from router.responses_store import input_items, not_found


def _status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


class _Turn:
    """One request's place in its conversation: the items before it and its own (to store)."""

    def __init__(self, front: OpenAIFront, req: ResponsesRequest) -> None:
        self.store = front.responses
        self.prior = self.store.conversation(req.previous_response_id) if req.previous_response_id is not None else []
        self.keep = req.store is not False and self.store.enabled

    def done(self, out: dict[str, Any], req: ResponsesRequest) -> dict[str, Any]:
        """The finished response, stored when asked (`store` says whether it was)."""
        if self.keep:
            out["store"] = self.store.put(out, self.prior, input_items(req.input))
        return out


async def respond(front: OpenAIFront, body: Any, request: Request) -> Response:
    req = parse(ResponsesRequest, body)
    assert isinstance(req, ResponsesRequest)
    turn = _Turn(front, req)
    job = await _fitted(front, req, turn.prior)
    rid = "resp_" + job.reqs[0].request_id  # unique (stored), even under a client's X-Request-Id
    try:
        if req.stream:
            return await _stream(front, job, req, rid, request, turn)
        return await _until_disconnect(request, _whole(front, job, req, rid, turn))
    except _Gone:
        return Response(status_code=499)


async def _fitted(front: OpenAIFront, req: ResponsesRequest, prior: list[dict[str, Any]]) -> Job:
    """The request's job; with `truncation: "auto"`, of the longest end of the conversation that
    starts a turn and leaves max_output_tokens (at least 1) of the context, found by bisection
    (when not even the last turn fits, that turn, which the context check then refuses)."""
    job = await front.job(to_chat(req, prior))
    ctx = max((m.max_model_len for m in front.service.models()), default=0)
    room = req.max_output_tokens or 1

    async def fits(j: Job) -> bool:
        return len(await front.service.prompt_ids(j.reqs[0], j.images)) + room <= ctx

    if req.truncation != "auto" or not ctx or await fits(job):
        return job
    cuts, best = turn_starts(req, prior), None
    lo, hi = 0, len(cuts) - 1
    while lo <= hi:  # the first cut that fits: dropping more turns only shortens the prompt
        mid = (lo + hi) // 2
        j = await front.job(to_chat(req, prior, cuts[mid]))
        if await fits(j):
            best, hi = j, mid - 1
        else:
            lo = mid + 1
    if best is None and cuts:
        best = await front.job(to_chat(req, prior, cuts[-1]))
    return best or job


async def _whole(front: OpenAIFront, job: Job, req: ResponsesRequest, rid: str, turn: _Turn) -> Response:
    choice, items = Choice(job, 0, front.tok), ResponseItems(req.carries_reasoning)
    async with aclosing(front.events(job)) as ev:
        async for _, c in ev:
            d = choice.delta(c)
            if d is not None:
                items.feed(d["delta"])
    items.close(_status(choice.finish))
    out = response(rid, job.model, req, items.items, _status(choice.finish), choice.finish, usage([choice]))
    return _json(200, turn.done(out, req))


async def _stream(
    front: OpenAIFront, job: Job, req: ResponsesRequest, rid: str, request: Request, turn: _Turn
) -> Response:
    ev = await front.opened(job, request)
    choice, items = Choice(job, 0, front.tok), ResponseItems(req.carries_reasoning)

    async def body() -> AsyncIterator[bytes]:
        head = response(rid, job.model, req, [], "in_progress", None, None, store=turn.keep)
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
            done = turn.done(response(rid, job.model, req, items.items, status, choice.finish, usage([choice])), req)
            yield _sse_event(items.event(f"response.{status}", response=done))
        except Abort as a:  # mid-stream: an error event, then the end
            err = ApiError.from_status(a.code, a.msg)
            yield _sse_event(items.event("error", code=err.code, message=err.message, param=err.param))
        finally:
            await ev.aclose()

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def register(app: FastAPI, front: OpenAIFront, limit: int, hints: Callable[[Request], None]) -> None:
    """The Responses routes on `app`; `hints` sets the request's admission hints (its API key)."""
    from router.http_limits import read_json  # noqa: PLC0415 (beside the other routes' reader)

    store = front.responses

    @app.post("/v1/responses")
    async def responses(request: Request):
        hints(request)
        return await respond(front, await read_json(request, limit), request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str):
        s = store.get(response_id)
        if s is None:
            raise not_found(response_id)
        return _json(200, s.response)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str):
        if not store.delete(response_id):
            raise not_found(response_id)
        return _json(200, {"id": response_id, "object": "response.deleted", "deleted": True})

    @app.get("/v1/responses/{response_id}/input_items")
    async def listed(response_id: str, limit: int = 20, order: str = "desc", after: str | None = None):
        if not 1 <= limit <= 100:
            raise ApiError(400, f"limit must be between 1 and 100 (got {limit})", param="limit")
        if order not in ("asc", "desc"):
            raise ApiError(400, f"order must be 'asc' or 'desc' (got {order!r})", param="order")
        return _json(200, store.page(response_id, limit, order, after))

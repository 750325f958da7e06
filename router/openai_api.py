"""OpenAI-compatible HTTP on the router (FastAPI on the router's loop): `/v1/models`,
`/v1/completions`, `/v1/chat/completions`, `/health`, `/metrics`, and SGLang's `/generate`
(router/sglang_generate.py). Each choice is one in-process `GenerateService.generate`; errors
take OpenAI's shape (docs/api.md)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterator
from contextlib import aclosing

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from proto import pb
from router import structured_fields
from router.client_hints import HINTS, Hints, from_headers
from router.errors import NO_DECODE, Abort
from router.health import readiness
from router.http_limits import check_expansion, read_json
from router.images.decode import ImageRefused
from router.images.prepare import Prepared
from router.model_names import model_root, names_of
from router.openai_chat import ChatFront
from router.openai_choices import Choice, Job, usage
from router.openai_models import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    bad,
    from_validation,
    parse,
    prompts,
    sampling,
    seed_of,
)
from router.prompt_truncation import kept_tokens, truncated
from router.request import Chunk
from router.responses_store import ResponseStore
from router.version import pdserve_version

log = logging.getLogger("pdserve.http")
RENDER_INLINE_CHARS = 65536  # chat messages up to this many characters are rendered on the loop
# OpenAI's routes of other kinds of model: a 404 saying what this server serves
_NOT_SERVED = ("/v1/embeddings", "/v1/audio/", "/v1/images/", "/v1/moderations")


def _json(status: int, obj: dict, retry_after_s: float | None = None) -> Response:
    """429 / 503 say when to come back: the admission's estimate, else in a second."""
    headers = None
    if status in (429, 503):
        headers = {"Retry-After": str(max(1, math.ceil(retry_after_s or 0)))}
    return Response(json.dumps(obj), status, headers, media_type="application/json")


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _sse_event(ev: dict) -> bytes:
    """A server-sent event named by its `type` (the Responses and Anthropic streams)."""
    return f"event: {ev['type']}\ndata: {json.dumps(ev)}\n\n".encode()


class _Gone(Exception):
    """The HTTP client disconnected."""


async def _until_disconnect(request: Request, work: Awaitable):
    """Run `work`; if the client disconnects first, cancel it (its requests unwind) and raise _Gone."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # let its requests unwind
    if task.cancelled():
        raise _Gone
    return task.result()


class OpenAIFront:
    """What the routes do, over one GenerateService."""

    def __init__(self, service):
        self.service = service
        self._chat: ChatFront | None = None
        self.responses = ResponseStore(service.cfg.responses_store_mb << 20)  # stored /v1/responses
        service.gauge_sources.append(self.responses.gauges)

    @property
    def tok(self):
        return self.service.tokenizer

    def model(self, name: str | None) -> str:
        """The served model a body's `model` names; unset: the one model served (several: a 400)."""
        known = self.service.models()
        if not known:  # nothing registered (yet, or any more): a state to wait out, not a bad name
            raise ApiError(503, NO_DECODE, "service_unavailable", None, "unavailable")
        if name is None:
            if len(known) == 1:
                return known[0].id
            ids = ", ".join(m.id for m in known)
            raise ApiError(400, f"'model' is required: this router serves {ids}", "invalid_request_error", "model")
        for m in known:
            if name in names_of(m, self.service.cfg.served_model_name):
                return m.id
        ids = ", ".join(m.id for m in known)
        raise ApiError(
            404, f"model {name!r} not found; serving: {ids}", "invalid_request_error", "model", "model_not_found"
        )

    @property
    def chat(self) -> ChatFront:
        if self._chat is None:
            cfg = self.service.cfg
            self._chat = ChatFront(
                self.tok, cfg.reasoning_parser, cfg.tool_call_parser, cfg.chat_template_text(), cfg.template_kwargs
            )
        return self._chat

    async def render(self, req: ChatRequest):
        """The chat request's prompt (openai_chat.ChatFront.prepare). The template's input is
        bounded like a prompt before it is rendered, and a long conversation renders in a thread,
        so the loop keeps relaying other streams."""
        chars = req.text_chars()
        self.service.check_prompt_chars(chars, "messages")
        cf = self.chat
        try:
            return cf.prepare(req) if chars <= RENDER_INLINE_CHARS else await asyncio.to_thread(cf.prepare, req)
        except ImageRefused as e:
            raise self.service.images.refuse(e.reason, str(e)) from None

    def image_bounds(self, req: CompletionRequest | ChatRequest) -> tuple[int, int] | None:
        """The request's mm_processor_kwargs as its images' pixel bounds (400 naming the key)."""
        if req.mm_processor_kwargs is None:
            return None
        try:
            return self.service.images.size_bounds(req.mm_processor_kwargs)
        except ValueError as e:
            raise bad(str(e), "mm_processor_kwargs") from None

    async def job(self, req: CompletionRequest | ChatRequest) -> Job:
        """The GenerateRequests of an HTTP body: n per prompt (completions take a batch of
        prompts; choice j * n + i is sample i of prompt j; with a seed, sample i uses seed + i, wrapped: `seed_of`)."""
        chat = isinstance(req, ChatRequest)
        model = self.model(req.model)
        if self.tok is not None:
            req.know_special_tokens(self.tok.added_tokens)
        sp = sampling(req)
        if sp.HasField("logprobs") and self.tok is None:
            raise bad("logprobs need a tokenizer on the router", "logprobs")
        if req.prompt_logprobs is not None and self.tok is None:  # each alternative's text
            raise bad("prompt_logprobs need a tokenizer on the router", "prompt_logprobs")
        prep = None
        images: list[Prepared] = []
        bounds = self.image_bounds(req)
        if isinstance(req, ChatRequest):
            prep = await self.render(req)
            if prep.constraint is not None:
                sp.constraint.CopyFrom(prep.constraint)
            images = await self.service.images.prepare(prep.images, bounds) if prep.images else []
        else:
            c = structured_fields.constraint(req)
            if c is not None:
                sp.constraint.CopyFrom(c)
        ps = [prep.prompt] if prep is not None else prompts(req)
        echo = not chat and req.echo
        n, rid = req.n, uuid.uuid4().hex
        named = (HINTS.get() or Hints()).request_id  # the client's X-Request-Id: the answer's id
        check_expansion(len(ps), n, self.service.expansion_limit())
        job = Job(model, chat, named or rid, n, req.no_output, sp.logprobs if sp.HasField("logprobs") else None)
        if named:  # the nodes' ids start with it, and stay unique when a client sends one twice
            rid = f"{named}-{rid[:8]}"
        job.output = prep.output if prep is not None else None
        job.chat_echo = prep.echo if prep is not None else ""
        as_ids = req.return_tokens_as_token_ids
        job.token_ids = bool(req.return_token_ids)
        job.ids_as_text = self.service.cfg.return_tokens_as_token_ids if as_ids is None else as_ids
        job.prompt_logprobs = req.prompt_logprobs
        job.images = images
        prio = pb.PRIORITY_UNSPECIFIED  # the body's class: its name, or vLLM's integer (above 0: batch)
        if req.priority is not None:
            batch = req.priority == "batch" or (isinstance(req.priority, int) and req.priority > 0)
            prio = pb.PRIORITY_BATCH if batch else pb.PRIORITY_INTERACTIVE
        keep = kept_tokens(req, self.service, bool(images))
        for j, p in enumerate(ps):
            base = pb.GenerateRequest(sampling=sp, priority=prio)
            typed = isinstance(p, str)
            if keep is not None:  # the model sees the last `keep` tokens: they are the prompt from here on
                p = await truncated(self.service, p, keep)
            if isinstance(p, str) and (not echo or not sp.HasField("prompt_logprobs")):
                base.prompt = p
            elif isinstance(p, str):  # echo with logprobs: the ids the logprobs are for
                if self.tok is None:
                    raise bad("this router has no tokenizer: send the prompt as token ids", "prompt")
                base.prompt_token_ids.extend(await self.service.encode(p))
            else:
                base.prompt_token_ids.extend(p)
            text = None
            if echo:
                # ids are echoed as vLLM detokenizes a prompt: special tokens kept (<|im_start|> ...)
                text = (
                    p
                    if isinstance(p, str)
                    else await self.service.text.decode(p, False)
                    if self.tok is not None
                    else ""
                )
            for i in range(n):
                r = pb.GenerateRequest()
                r.CopyFrom(base)
                r.request_id = rid if len(ps) * n == 1 else f"{rid}-{j * n + i}"
                if sp.HasField("seed"):
                    r.sampling.seed = seed_of(sp.seed, i)  # wraps within the engine's range
                job.reqs.append(r)
                job.echoes.append(text)
                job.typed.append(typed)
                job.prompt_ids.append(list(base.prompt_token_ids))
        return job

    async def events(self, job: Job, only: list[int] | None = None) -> AsyncGenerator[tuple[int, Chunk], None]:
        """(choice, chunk) as they come, over every choice's generate (`only`: these choices');
        raises the first Abort."""
        run = list(range(len(job.reqs))) if only is None else only
        if len(run) == 1:
            async with aclosing(self.service.generate(job.reqs[run[0]], job.images)) as g:
                async for c in g:
                    yield run[0], c
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, req: pb.GenerateRequest) -> None:
            try:
                async with aclosing(self.service.generate(req, job.images)) as g:
                    async for c in g:
                        q.put_nowait((i, c))
                q.put_nowait((i, None))
            except Abort as a:
                q.put_nowait((i, a))

        tasks = [asyncio.ensure_future(pump(i, job.reqs[i])) for i in run]
        try:
            left = len(tasks)
            while left:
                i, c = await q.get()
                if isinstance(c, Abort):
                    raise c
                if c is None:
                    left -= 1
                else:
                    yield i, c
        finally:
            for t in tasks:
                t.cancel()

    # ---- answers --------------------------------------------------------------------------------
    async def whole(self, job: Job) -> Response:
        choices = [Choice(job, i, self.tok) for i in range(len(job.reqs))]
        async with aclosing(self.events(job)) as ev:
            async for i, c in ev:
                choices[i].add(c)
        out = job.head(chunk=False)
        out["choices"] = [c.whole() for c in choices]
        if job.chat and job.token_ids:  # one prompt for every choice
            out["prompt_token_ids"] = choices[0].prompt_ids if choices else []
        if job.chat and job.prompt_logprobs is not None:  # vLLM's chat: the one prompt's, at the top
            out["prompt_logprobs"] = choices[0].prompt_lps if choices else None
        out["usage"] = usage(choices)
        return _json(200, out)

    async def opened(self, job: Job, request: Request) -> AsyncGenerator[tuple[int, Chunk], None]:
        """The job's events with the first one awaited here: an error before it raises now (an
        HTTP status), a disconnect raises _Gone; later ones come from the generator."""
        ev = self.events(job)
        try:
            first = await _until_disconnect(request, ev.__anext__())
        except StopAsyncIteration:
            first = None
        except BaseException:
            await ev.aclose()
            raise

        async def rest() -> AsyncGenerator[tuple[int, Chunk], None]:
            try:
                if first is not None:
                    yield first
                async for x in ev:
                    yield x
            finally:
                await ev.aclose()

        return rest()

    async def stream(self, job: Job, include_usage: bool, request: Request, continuous: bool = False) -> Response:
        """Errors before the first chunk get an HTTP status; later ones an error event, then the end.
        continuous: every chunk with a choice carries its choice's usage so far (vLLM's continuous_usage_stats)."""
        ev = await self.opened(job, request)
        choices = [Choice(job, i, self.tok) for i in range(len(job.reqs))]
        head = job.head(chunk=True)

        async def body() -> AsyncIterator[bytes]:
            roles = job.chat  # chat opens each choice with its role, before the first event's delta

            def opening(first: Chunk | None) -> Iterator[bytes]:
                for k, ch in enumerate(choices):
                    role = {"index": ch.index, "delta": {"role": "assistant", "content": ""}}
                    obj = dict(head, choices=[dict(role, logprobs=None, finish_reason=None)])
                    if k == 0 and job.token_ids:  # the prompt's ids, once, on the stream's first chunk
                        obj["prompt_token_ids"] = list(first.prompt_token_ids) if first else []
                    if continuous and first is not None:  # vLLM's: the prompt so far, no tokens yet
                        p = first.prompt_tokens
                        obj["usage"] = {
                            "prompt_tokens": p,
                            "completion_tokens": 0,
                            "total_tokens": p,
                            "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
                        }
                    yield _sse(obj)

            try:
                async for i, c in ev:
                    if roles:
                        roles = False
                        for b in opening(c):
                            yield b
                    d = choices[i].delta(c)
                    if d is not None:
                        # vLLM's: each chunk's usage is its own choice's so far (its prompt and its tokens)
                        yield _sse(dict(head, choices=[d], **({"usage": usage([choices[i]])} if continuous else {})))
                if roles:
                    for b in opening(None):
                        yield b
                if include_usage:
                    yield _sse(dict(head, choices=[], usage=usage(choices)))
            except Abort as a:  # mid-stream: an error event, then the end
                yield _sse(ApiError.from_status(a.code, a.msg).body())
            finally:
                await ev.aclose()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def make_app(service, front: OpenAIFront | None = None) -> FastAPI:
    """The router's HTTP app over `service` (router/service.py); `front`: the router's, shared with
    its gRPC Chat (made here when not given)."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    front = front or OpenAIFront(service)
    origins = [o for o in service.cfg.allowed_origins if o != "none"]
    if origins:  # browsers' cross-origin calls (a preflight OPTIONS, then the call with the header)
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"], expose_headers=["*"]
        )

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return _json(e.status, e.body(), e.retry_after_s)

    @app.exception_handler(Abort)
    async def abort(request, a: Abort):
        e = ApiError.from_abort(a)
        return _json(e.status, e.body(), e.retry_after_s)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        err = from_validation(list(e.errors()))
        return _json(err.status, err.body())

    @app.exception_handler(Exception)
    async def internal(request, e: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return _json(500, ApiError(500, f"internal error: {type(e).__name__}", "internal_error").body())

    @app.exception_handler(HTTPException)
    async def no_route(request: Request, e: HTTPException):
        where = f"{request.method} {request.url.path}"
        if e.status_code == 405:  # the path exists, for other methods
            allow = {k.lower(): v for k, v in (e.headers or {}).items()}.get("allow", "")
            msg = f"method {request.method} is not allowed on {request.url.path}" + (f" (use {allow})" if allow else "")
            r = _json(405, ApiError(405, msg, code="method_not_allowed").body())
            if allow:
                r.headers["Allow"] = allow
            return r
        msg = f"no route {where}" if e.status_code == 404 else (str(e.detail) or where)
        if e.status_code == 404 and request.url.path.startswith(_NOT_SERVED):
            msg = f"{where}: this server serves text generation only (completions, chat, responses, messages)"
        return _json(e.status_code, ApiError(e.status_code, msg).body())

    @app.get("/health")
    async def health():
        """200 while the router can serve; 503 saying why while it cannot (a load balancer's probe)."""
        return _json(*readiness(service))

    @app.get("/version")
    async def version():
        return _json(200, {"version": pdserve_version()})

    @app.get("/ping")
    @app.post("/ping")
    async def ping():  # what some hosting platforms probe; the same answer as /health
        return await health()

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card(m: pb.ModelInfo) -> dict:
        return {
            "id": m.id,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "pdserve",
            "root": model_root(m.path),  # vLLM's: where clients load the tokenizer (vllm bench serve does)
            "parent": None,
            "max_model_len": m.max_model_len,
        }

    @app.get("/v1/models")
    async def models():
        return _json(200, {"object": "list", "data": [model_card(m) for m in service.models()]})

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        """OpenAI's retrieve: the model called `name` (any of its names; ORG/NAME ids hold a slash)."""
        wanted = front.model(name)  # 404 naming the ids, or 503 with no node
        return _json(200, next(model_card(m) for m in service.models() if m.id == wanted))

    async def answer(req: CompletionRequest | ChatRequest, request: Request) -> Response:
        hints(request)
        if req.stream_options is not None and not req.stream:  # as vLLM and OpenAI's reference
            raise bad("'stream_options' is only allowed with 'stream': true", "stream_options")
        job = await front.job(req)
        try:
            if req.stream:
                usage = req.include_usage or service.cfg.enable_force_include_usage
                return await front.stream(job, usage, request, req.continuous_usage)
            return await _until_disconnect(request, front.whole(job))
        except _Gone:
            return Response(status_code=499)  # nobody reads it

    limit = service.cfg.max_body_bytes

    def hints(request: Request) -> None:
        """Admission's headers and API key, for this request's generate calls."""
        try:
            HINTS.set(from_headers(request.headers, service.creds))
        except ValueError as e:
            raise bad(str(e)) from None

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(parse(CompletionRequest, await read_json(request, limit)), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(parse(ChatRequest, await read_json(request, limit)), request)

    from router.openai_responses import register as register_responses  # it builds on this module's helpers

    register_responses(app, front, limit, hints)
    from router.openai_tokenize import register  # noqa: PLC0415

    register(app, front, limit)
    from router.anthropic_messages import register as register_messages  # noqa: PLC0415

    register_messages(app, front, limit, hints)
    from router.sglang_generate import register as register_generate  # noqa: PLC0415

    register_generate(app, front, limit, hints, _until_disconnect, _Gone)

    return app

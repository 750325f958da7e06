"""OpenAI-compatible HTTP on the router: `GET /v1/models`, `POST /v1/completions`,
`POST /v1/chat/completions`, streamed as server-sent events (`"stream": true`) or not.

Each HTTP request becomes one call to the router's own gRPC `Generation.Generate` (a channel to
its own port), so admission, routing, cancellation and metrics are exactly those of a gRPC client.
Chat messages are rendered to a prompt with the tokenizer's Jinja2 `chat_template`
(`add_generation_prompt=True`). A client that disconnects mid-stream cancels the gRPC call.

`GET /health` answers 200 `{"status": "ok", "decode_nodes": N}` while the router takes requests and
503 `{"status": "draining"}` once it drains (for HTTP load balancers and probes).

Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: 400 for bad
parameters, 404 for an unknown model or path, 429 when admission answers RESOURCE_EXHAUSTED, 503
when no node can serve.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc

from proto import pb, rpc
from proto.serving import channel

log = logging.getLogger("pdserve.http")

_HTTP_OF = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def from_rpc(cls, e: grpc.RpcError) -> ApiError:
        status, typ = _HTTP_OF.get(e.code(), (500, "internal_error"))
        return cls(status, e.details() or e.code().name, typ, code=e.code().name.lower())


def _bad(msg: str, param: str | None = None) -> ApiError:
    return ApiError(400, msg, "invalid_request_error", param)


def _num(body: dict, name: str, kind, lo=None, hi=None):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float) if kind is float else int):
        raise _bad(f"'{name}' must be {'a number' if kind is float else 'an integer'} (got {v!r})", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise _bad(f"'{name}' must be in [{lo}, {hi if hi is not None else 'inf'}] (got {v!r})", name)
    return kind(v)


def sampling(body: dict) -> pb.SamplingParams:
    """OpenAI parameters -> SamplingParams; the engine checks the rest (a gRPC INVALID_ARGUMENT -> 400)."""
    n = _num(body, "n", int)
    if n not in (None, 1):
        raise _bad(f"only n=1 is supported (got {n})", "n")
    if body.get("best_of") not in (None, 1):
        raise _bad("best_of is not supported", "best_of")
    if body.get("logprobs") not in (None, False, 0) or body.get("echo"):
        raise _bad("logprobs and echo are not supported", "logprobs" if body.get("logprobs") else "echo")
    sp = pb.SamplingParams(top_k=_num(body, "top_k", int) or 0, ignore_eos=bool(body.get("ignore_eos", False)))
    mt = _num(body, "max_completion_tokens", int, 1) or _num(body, "max_tokens", int, 1)
    if mt is not None:
        sp.max_tokens = mt
    for name, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0)):
        v = _num(body, name, float, lo, hi)
        if v is not None:
            setattr(sp, name, v)
    seed = _num(body, "seed", int)
    if seed is not None:
        sp.seed = seed
    stop = body.get("stop")
    stops = list(body.get("stop_token_ids") or ())
    if stop is not None:
        items = stop if isinstance(stop, list) else [stop]
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            raise _bad("'stop' takes token ids (integers) only; string stop sequences are not supported", "stop")
        stops += items
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stops):
        raise _bad(f"stop token ids must be non-negative integers (got {stops!r})", "stop")
    sp.stop_token_ids.extend(stops)
    return sp


class OpenAIServer:
    """The HTTP front end of a Router (`router.tokenizer`, `router.ListModels`) over `grpc_addr`."""

    def __init__(self, router, grpc_addr: str):
        self.router = router
        self.channel = channel(grpc_addr)
        self.stub = rpc.GenerationStub(self.channel)
        self.httpd: ThreadingHTTPServer | None = None
        self._env = None

    # ---- models and prompts ---------------------------------------------------------------------
    def models(self) -> list[pb.ModelInfo]:
        return list(self.stub.ListModels(pb.ListModelsRequest(), timeout=10).models)

    def _model(self, body: dict) -> str:
        name = body.get("model")
        if not isinstance(name, str) or not name:
            raise _bad("'model' is required", "model")
        known = self.models()
        if not known:  # nothing registered (yet, or any more): a state to wait out, not a bad name
            raise ApiError(503, "no live node serves a model now; retry shortly", "service_unavailable", None,
                           "unavailable")  # fmt: skip
        for m in known:
            if name in (m.id, m.path, Path(m.path).name):
                return m.id
        ids = ", ".join(m.id for m in known)
        raise ApiError(404, f"model {name!r} not found; serving: {ids}", "invalid_request_error", "model",
                       "model_not_found")  # fmt: skip

    def chat_prompt(self, messages) -> str:
        tok = self.router.tokenizer
        tmpl = tok.chat_template if tok is not None else None
        if tmpl is None:
            raise _bad("this model's tokenizer has no chat_template", "messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("'messages' must be a non-empty list", "messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
                raise _bad("each message needs a 'role' and 'content'", "messages")
            if isinstance(m["content"], list):  # content parts: keep the text ones
                m["content"] = "".join(p.get("text", "") for p in m["content"] if isinstance(p, dict))
        if self._env is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(msg):
                raise ValueError(msg)

            self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._env.globals["raise_exception"] = raise_exception
            self._env.filters["tojson"] = lambda v, indent=None, **_: json.dumps(v, ensure_ascii=False, indent=indent)
        try:
            return self._env.from_string(tmpl).render(messages=messages, add_generation_prompt=True)
        except Exception as e:
            raise _bad(f"the chat template refused the messages: {e}", "messages") from None

    def request(self, body: dict, chat: bool) -> tuple[str, pb.GenerateRequest]:
        model = self._model(body)
        sp = sampling(body)
        req = pb.GenerateRequest(request_id=uuid.uuid4().hex, sampling=sp)
        if chat:
            req.prompt = self.chat_prompt(body.get("messages"))
            return model, req
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str) and p:
            req.prompt = p
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            req.prompt_token_ids.extend(p)
        else:
            raise _bad("'prompt' must be a non-empty string or a list of token ids (batches are not supported)",
                       "prompt")  # fmt: skip
        return model, req

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self, host: str, port: int) -> int:
        srv = self

        class Handler(_Handler):
            server_ref = srv

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, name="openai-http", daemon=True).start()
        return self.httpd.server_address[1]

    def stop(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None
        self.channel.close()


class _Handler(BaseHTTPRequestHandler):
    server_ref: OpenAIServer
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        log.debug("%s " + fmt, self.address_string(), *args)

    def _json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        if status in (429, 503):  # full, or no node takes new work now (draining): come back soon
            self.send_header("Retry-After", "1")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, e: ApiError) -> None:
        self._json(e.status, e.body())

    def do_GET(self):
        try:
            if self.path.rstrip("/") == "/health":  # for HTTP load balancers and probes
                router = self.server_ref.router
                live = sum(1 for e, _ in router.registry.snapshot() if e.alive and not e.info.draining
                           and e.kind == pb.NODE_KIND_DECODE)  # fmt: skip
                if router.draining:
                    self._json(503, {"status": "draining"})
                else:
                    self._json(200, {"status": "ok", "decode_nodes": live})
                return
            if self.path.rstrip("/") != "/v1/models":
                raise ApiError(404, f"no route GET {self.path}", "invalid_request_error")
            created = int(time.time())
            data = [{"id": m.id, "object": "model", "created": created, "owned_by": "pdserve",
                     "max_model_len": m.max_model_len} for m in self.server_ref.models()]  # fmt: skip
            self._json(200, {"object": "list", "data": data})
        except ApiError as e:
            self._error(e)
        except grpc.RpcError as e:
            self._error(ApiError.from_rpc(e))

    def do_POST(self):
        path = self.path.rstrip("/")
        try:
            if path not in ("/v1/completions", "/v1/chat/completions"):
                raise ApiError(404, f"no route POST {self.path}", "invalid_request_error")
            n = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(n) or b"null")
            except ValueError as e:
                raise _bad(f"the body is not JSON: {e}") from None
            if not isinstance(body, dict):
                raise _bad("the body must be a JSON object")
            chat = path.endswith("chat/completions")
            model, req = self.server_ref.request(body, chat)
            if body.get("stream"):
                self._stream(model, req, chat, bool((body.get("stream_options") or {}).get("include_usage")))
            else:
                self._whole(model, req, chat)
        except ApiError as e:
            self._error(e)
        except grpc.RpcError as e:
            self._error(ApiError.from_rpc(e))

    # ---- responses ------------------------------------------------------------------------------
    @staticmethod
    def _head(model: str, chat: bool, chunk: bool) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
        return {"id": "", "object": obj, "created": int(time.time()), "model": model}

    def _whole(self, model: str, req, chat: bool) -> None:
        text, n, finish, prompt_tokens = [], 0, None, 0
        for m in self.server_ref.stub.Generate(req):
            text.append(m.text)
            n += len(m.token_ids)
            prompt_tokens = prompt_tokens or m.prompt_tokens
            finish = m.finish_reason or finish
        out = self._head(model, chat, chunk=False)
        out["id"] = ("chatcmpl-" if chat else "cmpl-") + req.request_id
        choice = {"index": 0, "finish_reason": finish}
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
        else:
            choice.update(text="".join(text), logprobs=None)
        out["choices"] = [choice]
        out["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        self._json(200, out)

    def _stream(self, model: str, req, chat: bool, usage: bool) -> None:
        call = self.server_ref.stub.Generate(req)
        try:
            first = next(call)  # errors before the first token still get an HTTP status
        except StopIteration:
            first = None
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        head = self._head(model, chat, chunk=True)
        head["id"] = ("chatcmpl-" if chat else "cmpl-") + req.request_id
        n = prompt_tokens = 0

        def send(obj) -> None:
            self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            self.wfile.flush()

        try:
            if chat:
                send(dict(head, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""},
                                          "finish_reason": None}]))  # fmt: skip
            msgs = [] if first is None else [first]
            for m in _chain(msgs, call):
                n += len(m.token_ids)
                prompt_tokens = prompt_tokens or m.prompt_tokens
                fin = m.finish_reason or None
                if not m.text and fin is None:
                    continue
                if chat:
                    delta = {"content": m.text} if m.text else {}
                    choice = {"index": 0, "delta": delta, "finish_reason": fin}
                else:
                    choice = {"index": 0, "text": m.text, "logprobs": None, "finish_reason": fin}
                send(dict(head, choices=[choice]))
            if usage:
                send(dict(head, choices=[], usage={"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                                   "total_tokens": prompt_tokens + n}))  # fmt: skip
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except grpc.RpcError as e:  # mid-stream: an error event, then the end
            try:
                send(ApiError.from_rpc(e).body())
                self.wfile.write(b"data: [DONE]\n\n")
            except OSError:
                pass
        except OSError:  # the client went away: cancel the request
            call.cancel()
        finally:
            call.cancel()


def _chain(first: list, rest):
    yield from first
    yield from rest

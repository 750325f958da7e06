"""OpenAI-compatible HTTP on the router: `GET /v1/models`, `POST /v1/completions`,
`POST /v1/chat/completions`, streamed as server-sent events (`"stream": true`) or not.

Each HTTP request becomes one call to the router's own gRPC `Generation.Generate` per choice (a
channel to its own port; `n` > 1 makes n calls, choice i with seed + i), so admission, routing,
cancellation and metrics are exactly those of a gRPC client. Options map onto SamplingParams
(`sampling`); the router matches string `stop` sequences (router/stops.py); `echo` puts the
prompt before the output, and with `logprobs` asks for the prompt's logprobs too, shaped as
OpenAI's completions (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) or chat
(`content: [{token, logprob, bytes, top_logprobs}]`) logprobs.
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
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
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


MAX_N = 16  # most choices per request
_REFUSED = ("logit_bias", "suffix", "tools", "functions")


def _flag(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise _bad(f"'{name}' must be true or false (got {v!r})", name)
    return bool(v)


def _stops(body: dict) -> tuple[list[str], list[int]]:
    """`stop`: a string, a list of strings, or (an extension) token ids; plus `stop_token_ids`."""
    stop = body.get("stop")
    items = [] if stop is None else stop if isinstance(stop, list) else [stop]
    strs = [t for t in items if isinstance(t, str)]
    toks = [t for t in items if isinstance(t, int) and not isinstance(t, bool)]
    if len(strs) + len(toks) != len(items):
        raise _bad(f"'stop' takes a string or a list of strings (got {stop!r})", "stop")
    ids = toks + list(body.get("stop_token_ids") or ())
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise _bad(f"stop token ids must be non-negative integers (got {ids!r})", "stop_token_ids")
    return strs, ids


def choices(body: dict) -> int:
    """`n`: independent samples of the same prompt (one gRPC request each)."""
    n = _num(body, "n", int, 1, MAX_N) or 1
    if body.get("best_of") not in (None, n):
        raise _bad("best_of other than n is not supported", "best_of")
    return n


def sampling(body: dict, chat: bool = False) -> pb.SamplingParams:
    """OpenAI parameters -> SamplingParams; the engine checks the rest (a gRPC INVALID_ARGUMENT ->
    400). `max_tokens: 0` asks for one token (the caller returns none of it). Logprobs: chat
    `logprobs: true` with `top_logprobs: k`; completions `logprobs: k` and, with `echo`, the
    prompt's too (prompt_logprobs)."""
    for name in _REFUSED:
        if body.get(name) not in (None, {}, []):
            raise _bad(f"'{name}' is not supported", name)
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none", "auto"):
            raise _bad(f"'{name}' is not supported (no tools)", name)
    rf = body.get("response_format")
    if rf not in (None, {}) and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise _bad("only response_format {'type': 'text'} is supported", "response_format")
    sp = pb.SamplingParams(top_k=_num(body, "top_k", int) or 0, ignore_eos=_flag(body, "ignore_eos"))
    mt = _num(body, "max_completion_tokens", int, 0)
    mt = _num(body, "max_tokens", int, 0) if mt is None else mt
    if mt is not None:
        sp.max_tokens = max(mt, 1)  # 0: generate one token and return none (prompt logprobs only)
    for name, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0), ("presence_penalty", -2.0, 2.0),
                         ("frequency_penalty", -2.0, 2.0), ("repetition_penalty", 0.0, 10.0)):  # fmt: skip
        v = _num(body, name, float, lo, hi)
        if v is not None:
            setattr(sp, name, v)
    for name in ("seed", "min_tokens"):
        v = _num(body, name, int, 0)
        if v is not None:
            setattr(sp, name, v)
    strs, ids = _stops(body)
    sp.stop.extend(strs)
    sp.stop_token_ids.extend(ids)
    if chat:
        if _flag(body, "logprobs"):
            sp.logprobs = _num(body, "top_logprobs", int, 0, 20) or 0
        elif body.get("top_logprobs") is not None:
            raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if body.get("echo"):
            raise _bad("'echo' is not supported for chat completions", "echo")
    else:
        if body.get("top_logprobs") is not None:
            raise _bad("'top_logprobs' is a chat option; completions take 'logprobs': N", "top_logprobs")
        lp = body.get("logprobs")
        if lp is not None and lp is not False:
            sp.logprobs = _num(body, "logprobs", int, 0, 20)
        if _flag(body, "echo") and sp.HasField("logprobs"):
            sp.prompt_logprobs = sp.logprobs
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

    def request(self, body: dict, chat: bool) -> Job:
        """The gRPC requests for an HTTP body: n per prompt (completions take a batch of
        prompts; choice j * n + i is sample i of prompt j)."""
        model = self._model(body)
        sp, n = sampling(body, chat), choices(body)
        if sp.HasField("logprobs") and self.router.tokenizer is None:
            raise _bad("logprobs need a tokenizer on the router", "logprobs")
        rid = uuid.uuid4().hex
        prompts = [self.chat_prompt(body.get("messages"))] if chat else _prompts(body.get("prompt"))
        echo = not chat and _flag(body, "echo")
        tok = self.router.tokenizer
        job = Job(model, chat, rid, n, body.get("max_completion_tokens", body.get("max_tokens")) == 0,
                  sp.logprobs if sp.HasField("logprobs") else None)  # fmt: skip
        for j, p in enumerate(prompts):
            req = pb.GenerateRequest(sampling=sp)
            if isinstance(p, str) and (not echo or not sp.HasField("prompt_logprobs")):
                req.prompt = p
            elif isinstance(p, str):  # echo with logprobs: the ids the logprobs are for
                if tok is None:
                    raise _bad("this router has no tokenizer: send the prompt as token ids", "prompt")
                req.prompt_token_ids.extend(tok.encode(p))
            else:
                req.prompt_token_ids.extend(p)
            text = p if isinstance(p, str) else tok.decode(p) if tok is not None else ""
            for i in range(n):  # independent samples; with a seed, sample i uses seed + i
                r = pb.GenerateRequest()
                r.CopyFrom(req)
                r.request_id = rid if len(prompts) * n == 1 else f"{rid}-{j * n + i}"
                if sp.HasField("seed"):
                    r.sampling.seed = sp.seed + i
                job.reqs.append(r)
                job.echoes.append(text if echo else None)
                job.prompt_ids.append(list(req.prompt_token_ids))
        return job

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
            job = self.server_ref.request(body, path.endswith("chat/completions"))
            if body.get("stream"):
                self._stream(job, bool((body.get("stream_options") or {}).get("include_usage")))
            else:
                self._whole(job)
        except ApiError as e:
            self._error(e)
        except grpc.RpcError as e:
            self._error(ApiError.from_rpc(e))

    # ---- responses ------------------------------------------------------------------------------
    @staticmethod
    def _head(job: Job, chunk: bool) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if job.chat else "text_completion"
        return {"id": ("chatcmpl-" if job.chat else "cmpl-") + job.id, "object": obj, "created": int(time.time()),
                "model": job.model}  # fmt: skip

    def _whole(self, job: Job) -> None:
        q, calls = _start(self.server_ref.stub, job.reqs)
        choices = [_Choice(job, i, self.server_ref.router.tokenizer) for i in range(len(job.reqs))]
        try:
            for i, m in _events(q, len(calls)):
                if isinstance(m, grpc.RpcError):
                    raise m
                if m is not None:
                    choices[i].add(m)
        finally:
            for c in calls:
                c.cancel()
        out = self._head(job, chunk=False)
        out["choices"] = [c.whole() for c in choices]
        out["usage"] = _usage(choices)
        self._json(200, out)

    def _stream(self, job: Job, usage: bool) -> None:
        q, calls = _start(self.server_ref.stub, job.reqs)
        choices = [_Choice(job, i, self.server_ref.router.tokenizer) for i in range(len(job.reqs))]
        events = _events(q, len(calls))
        try:
            first = next(events)  # errors before the first token still get an HTTP status
            if isinstance(first[1], grpc.RpcError):
                raise first[1]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            head = self._head(job, chunk=True)

            def send(obj) -> None:
                self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
                self.wfile.flush()

            if job.chat:
                for c in choices:
                    send(dict(head, choices=[{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}]))  # fmt: skip
            try:
                for i, m in _chain([first], events):
                    if isinstance(m, grpc.RpcError):
                        raise m
                    if m is not None:
                        for choice in choices[i].deltas(m):
                            send(dict(head, choices=[choice]))
                if usage:
                    send(dict(head, choices=[], usage=_usage(choices)))
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except grpc.RpcError as e:  # mid-stream: an error event, then the end
                try:
                    send(ApiError.from_rpc(e).body())
                    self.wfile.write(b"data: [DONE]\n\n")
                except OSError:
                    pass
        except OSError:  # the client went away: cancel the request
            pass
        finally:
            for c in calls:
                c.cancel()


MAX_BATCH = 64  # most prompts in one completions request


def _prompts(p) -> list[str | list[int]]:
    """`prompt`: a string, a list of token ids, or a batch (list) of either."""

    def ids(x) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if (isinstance(p, str) and p) or ids(p):
        return [p]
    if isinstance(p, list) and 0 < len(p) <= MAX_BATCH and all((isinstance(x, str) and x) or ids(x) for x in p):
        return p
    raise _bad(f"'prompt' must be a non-empty string, a list of token ids, or a list of up to {MAX_BATCH} of either",
               "prompt")  # fmt: skip


@dataclass
class Job:
    """One HTTP request: a gRPC request per choice, and how to shape the answer."""

    model: str
    chat: bool
    id: str
    n: int  # choices per prompt
    no_output: bool  # max_tokens 0: the one token generated is not returned
    logprobs: int | None  # alternatives per position, when logprobs were asked for
    reqs: list[pb.GenerateRequest] = field(default_factory=list)  # per choice, in choice order
    echoes: list[str | None] = field(default_factory=list)  # per choice: with echo, its prompt's text
    prompt_ids: list[list[int]] = field(default_factory=list)  # per choice: its prompt's ids, when sent as ids


class _Choice:
    """One choice's text, tokens and logprobs as its gRPC messages arrive."""

    def __init__(self, job: Job, index: int, tok):
        self.job, self.index, self.tok = job, index, tok
        self.text: list[str] = []
        self.entries: list = []  # pb.TokenLogprob per returned token; echo: the prompt's first
        self.n = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.finish: str | None = None
        self.offset = 0  # completions text_offset of the next token
        self.started = False

    def _take(self, m) -> tuple[str, list]:
        """The text and logprob entries this message adds (echo: the prompt's on the first)."""
        text, entries = "", []
        if not self.started:
            self.started = True
            self.prompt_tokens, self.cached_tokens = m.prompt_tokens, m.cached_tokens
            echo, ids = self.job.echoes[self.index], self.job.prompt_ids[self.index]
            if echo is not None:
                text = echo
                if self.job.logprobs is not None and ids:  # NaN: the first token has no logprob
                    entries = [pb.TokenLogprob(token_id=ids[0], logprob=float("nan"))]
                    entries += list(m.prompt_logprobs)
        if not self.job.no_output:
            text += m.text
            entries += list(m.logprobs)
            self.n += len(m.token_ids)
        self.finish = m.finish_reason or self.finish
        return text, entries

    def add(self, m) -> None:
        text, entries = self._take(m)
        self.text.append(text)
        self.entries += entries

    def whole(self) -> dict:
        c = {"index": self.index, "finish_reason": self.finish}
        lp = self._logprobs(self.entries) if self.job.logprobs is not None else None
        if self.job.chat:
            c["message"] = {"role": "assistant", "content": "".join(self.text)}
            c["logprobs"] = lp
        else:
            c.update(text="".join(self.text), logprobs=lp)
        return c

    def deltas(self, m) -> list[dict]:
        text, entries = self._take(m)
        fin = m.finish_reason or None
        if not text and not entries and fin is None:
            return []
        lp = self._logprobs(entries) if self.job.logprobs is not None else None
        if self.job.chat:
            return [{"index": self.index, "delta": {"content": text} if text else {}, "logprobs": lp,
                     "finish_reason": fin}]  # fmt: skip
        return [{"index": self.index, "text": text, "logprobs": lp, "finish_reason": fin}]

    def _str(self, token_id: int) -> str:
        return self.tok.decode([token_id])

    def _logprobs(self, entries) -> dict:
        if self.job.chat:

            def one(t, lp):
                s = self._str(t)
                return {"token": s, "logprob": lp, "bytes": list(s.encode())}

            return {"content": [dict(one(e.token_id, e.logprob), top_logprobs=[one(t.token_id, t.logprob) for t in e.top])
                                for e in entries]}  # fmt: skip
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            s = self._str(e.token_id)
            first = e.logprob != e.logprob  # NaN marks the prompt's first token: no logprob
            out["tokens"].append(s)
            out["token_logprobs"].append(None if first else e.logprob)
            out["top_logprobs"].append(None if first else {self._str(t.token_id): t.logprob for t in e.top})
            out["text_offset"].append(self.offset)
            self.offset += len(s)
        return out


def _usage(choices: list[_Choice]) -> dict:
    p = sum(c.prompt_tokens for c in choices if c.index % c.job.n == 0)  # once per prompt
    n = sum(c.n for c in choices)
    cached = sum(c.cached_tokens for c in choices if c.index % c.job.n == 0)
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n,
            "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip


def _start(stub, reqs) -> tuple[queue.Queue, list]:
    """Start one Generate per request; a thread per call puts (index, message) on the queue,
    then (index, None) at its end or (index, RpcError)."""
    q: queue.Queue = queue.Queue()
    calls = [stub.Generate(r) for r in reqs]

    def pump(i: int, call) -> None:
        try:
            for m in call:
                q.put((i, m))
            q.put((i, None))
        except grpc.RpcError as e:
            q.put((i, e))

    for i, c in enumerate(calls):
        threading.Thread(target=pump, args=(i, c), name="openai-call", daemon=True).start()
    return q, calls


def _events(q: queue.Queue, n: int):
    left = n
    while left:
        i, m = q.get()
        if m is None or isinstance(m, grpc.RpcError):
            left -= 1
        yield i, m


def _chain(first: list, rest):
    yield from first
    yield from rest

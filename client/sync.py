"""Client: the blocking SDK (a gRPC channel to each router it is given)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
from grpc_health.v1 import health_pb2

from client import args
from client.chat import ChatProgress, ChatResult, chat_request, check_fields
from client.mux import MuxedCall, TokenStreams
from client.routers import GENERATION, Routers, StreamBase, connection, deadline, muxed_start
from client.types import GenerateResult, PdserveError, StreamChunk, build_request, chunk_from, chunk_from_delta
from proto import pb


class TokenStream(StreamBase):
    """Iterate for StreamChunks; close() (or the end of a `with` block) cancels the request."""

    def __iter__(self):
        yielded = False
        while True:
            try:
                for m in self._call:
                    if self.closed:  # what came in before the close is not the caller's any more
                        return
                    yielded = True
                    self.got += m.token_ids
                    yield chunk_from_delta(m) if isinstance(m, pb.TokenDelta) else chunk_from(m)
                return
            except grpc.RpcError as e:
                if not self._on_error(e, yielded):
                    return

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._call.cancel()

    cancel = close

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Client:
    def __init__(
        self,
        addr,
        timeout: float | None = None,
        api_key: str | None = None,
        tls_ca=None,
        tls_cert=None,
        tls_key=None,
        tls_server_name: str | None = None,
        token_streams: bool = True,
    ):
        """addr: the router's host:port, or several routers of the same pools ("a:1,b:2" or a list),
        tried in turn (client/routers.py). timeout: default deadline of every call (seconds).
        timeout=0 (or a call's) is a deadline already past. api_key: the router's client key
        (default: PDSERVE_API_KEY), surrounding whitespace dropped. TLS: tls_ca (PEM bytes, PEM
        text or a file path) verifies the router's certificate; tls_cert + tls_key (the same
        forms, both or neither) show the client's; tls_server_name is the name the router's
        certificate is checked against (default: the host dialed).
        token_streams: the tokens of every stream come on one token stream per router, batched one
        message per engine step (client/mux.py; docs/api.md, "Token streams"); False: each on its
        own call. A closed client (close(), the end of a `with` block) raises PdserveError
        FAILED_PRECONDITION "the client is closed" on every call."""
        self.timeout = args.timeout(timeout)
        self._r = Routers(addr, False, *connection(api_key, tls_ca, tls_cert, tls_key, tls_server_name))
        self._streams = TokenStreams(self._r.stubs, self._r.md) if token_streams else None
        self._first_model: str | None = None

    @property
    def addr(self) -> str:
        """The router calls go to first."""
        return self._r.addrs[self._r.cur]

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until a router serves and knows at least one live model (node); TimeoutError after
        `timeout` seconds, PdserveError at once when every router refuses the API key."""
        self._r.check_open()
        r, until = self._r, time.monotonic() + args.number("timeout", timeout)
        while True:
            for i, a in enumerate(r.addrs):
                left = until - time.monotonic()
                if left <= 0:
                    raise r.not_ready(timeout)
                try:
                    h = r.healths[i].Check(health_pb2.HealthCheckRequest(service=GENERATION), timeout=min(left, 2.0))
                    if h.status != health_pb2.HealthCheckResponse.SERVING:
                        r.why[a] = "not serving"
                    elif r.stubs[i].ListModels(pb.ListModelsRequest(), timeout=min(left, 2.0), metadata=r.md).models:
                        r.use(i)
                        return
                    else:
                        r.why[a] = "no live node"
                except grpc.RpcError as e:
                    r.refusal(e, a)
            time.sleep(min(0.1, max(0.0, until - time.monotonic())))

    def list_models(self, timeout: float | None = None) -> list[pb.ModelInfo]:
        """The models the current router serves (`ModelInfo`: id, live nodes, ...); `timeout`:
        this call's deadline in seconds (default: the client's)."""
        self._r.check_open()
        t = deadline(timeout, self.timeout)
        try:
            return list(
                self._r.stubs[self._r.cur].ListModels(pb.ListModelsRequest(), timeout=t, metadata=self._r.md).models
            )
        except grpc.RpcError as e:
            raise PdserveError.from_rpc(e) from None

    def stream(
        self, prompt: str | None = None, prompt_token_ids=None, timeout: float | None = None, **sampling
    ) -> TokenStream:
        """Chunks as the tokens come, for exactly one of `prompt` (text) or `prompt_token_ids`.
        `timeout`: the call's deadline in seconds (default: the client's; 0 or less: already past,
        DEADLINE_EXCEEDED). Options (docs/api.md; unset: the server's defaults): max_tokens,
        temperature, top_k, top_p, min_p, seed, stop_token_ids, ignore_eos, request_id, stop
        (strings), include_stop_str_in_output (the matched stop string stays in the text),
        skip_special_tokens (False: special tokens in the text too), min_tokens, presence_penalty,
        frequency_penalty, repetition_penalty, logprobs, prompt_logprobs, num_speculative_tokens,
        logit_bias ({token id: bias}), images (bytes, file paths or URLs, or one alone; one
        IMAGE_PLACEHOLDER each in the prompt), constraint (structured output: {"kind":
        "json_schema" | "json_object" | "regex" | "grammar" | "choice", "value": ...,
        "start_after_token": id}), cache_salt (cached prompt state shared only within a salt),
        admission_timeout_s (the longest wait to start; 0: no limit; unset: the router's),
        priority ("interactive", the default, or "batch"). A badly typed option raises TypeError
        or ValueError naming it. Closing the stream (or leaving its `with` block, or dropping it)
        cancels the request."""
        self._r.check_open()
        req = build_request(prompt, prompt_token_ids, **sampling)
        start = self._r.generate(req, deadline(timeout, self.timeout))
        return TokenStream(
            start if self._streams is None else muxed_start(start, req, self._streams, len(self._r.addrs), MuxedCall),
            self._r,
        )

    def generate(
        self, prompt: str | None = None, prompt_token_ids=None, timeout: float | None = None, **sampling
    ) -> GenerateResult:
        """The whole answer (`GenerateResult`: token_ids, text, finish_reason, timings, logprobs,
        the nodes that served it); the arguments as `stream`'s."""
        res = GenerateResult()
        with self.stream(prompt, prompt_token_ids, timeout=timeout, **sampling) as s:
            for c in s:
                res.add(c)
        return res

    def chat_stream(
        self,
        messages: list[dict],
        model: str | None = None,
        timeout: float | None = None,
        *,
        extra_body: dict | None = None,
        **fields,
    ) -> Iterator[dict]:
        """OpenAI's chat chunks as dicts, then `{"usage": ...}` (client/chat.py). `fields`: the rest
        of a chat completions body (tools, tool_choice, response_format, temperature, max_tokens,
        chat_template_kwargs, ...: router/openai_models.py ChatRequest's fields; another name is a
        TypeError naming it), `extra_body`: fields sent as they are, whatever their names (OpenAI's
        SDK's convention); `model` defaults to the router's first; `timeout` as `stream`'s. A
        router that fails mid-answer is replaced by the next, which goes on after the tokens
        received."""
        r = self._r
        r.check_open()
        check_fields(fields, extra_body)
        body = chat_request(messages, model or self._model(), fields, extra_body)
        go = ChatProgress(body, len(r.addrs), r.cur)
        while True:
            call = go.call(r, deadline(timeout, self.timeout))
            try:
                for m in call:
                    yield go.add(m)
                return
            except grpc.RpcError as e:
                r.check_open()  # closed under the call
                go.failed(e, r)
            finally:
                call.cancel()

    def chat(
        self,
        messages: list[dict],
        model: str | None = None,
        timeout: float | None = None,
        *,
        extra_body: dict | None = None,
        **fields,
    ) -> ChatResult:
        """The whole chat answer (`ChatResult`: `message` with content, reasoning_content,
        tool_calls); the arguments as `chat_stream`'s."""
        res = ChatResult()
        for chunk in self.chat_stream(messages, model, timeout, extra_body=extra_body, **fields):
            res.add(chunk)
        return res

    def _model(self) -> str:
        if self._first_model is None:
            models = self.list_models()
            if not models:
                raise PdserveError(grpc.StatusCode.UNAVAILABLE, "the router serves no model yet")
            self._first_model = models[0].id
        return self._first_model

    def close(self) -> None:
        """Closes the channels: streams under way end, and every later call raises PdserveError
        FAILED_PRECONDITION "the client is closed"."""
        if self._r.closed:
            return
        self._r.closed = True
        if self._streams is not None:
            self._streams.close()
        for c in self._r.chans:
            c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["Client", "StreamChunk", "TokenStream"]

"""SGLang's native `POST /generate` on the router's HTTP port (docs/api.md, "SGLang's /generate"):
`text` or `input_ids` (one prompt or a batch) with SGLang's `sampling_params`, mapped onto the same
GenerateRequests the OpenAI completions route sends (server defaults, admission, stop strings,
constraints and the per-request log line as there); the answer is SGLang's `text`, `output_ids`
and `meta_info`, whole or as a stream of cumulative events."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from types import SimpleNamespace
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ConfigDict, Field, ValidationError

from proto import pb
from router import structured_fields
from router.errors import Abort
from router.http_limits import check_expansion, read_json
from router.openai_choices import Job
from router.openai_models import (
    I32,
    MAX_BATCH,
    MAX_N,
    ApiError,
    Count,
    Float,
    NullIsUnset,
    bad,
    note_ignored,
    seed_of,
)
from router.request import Chunk
from router.stops import check_stops

ROUTE = "/generate"
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's, when a request does not say
MAX_TOP_LOGPROBS = 20  # the engine's most alternatives per position
# a client's rid, within the nodes' 128-character ids with the suffixes added here (`Generation.build`)
MAX_RID = 100
TokenId = Annotated[int, Field(ge=0, le=I32)]
# SGLang's fields this server has no equivalent of: refused by name unless unset (ignoring one
# would change the answer unseen)
_REFUSED = ("image_data", "video_data", "audio_data", "input_embeds", "lora_path", "token_ids_logprob")
_REFUSED_SAMPLING = ("structural_tag", "custom_params", "logit_bias", "stop_regex")
# sampling_params fields named as the engine's SamplingParams names them
_SAME_NAMES = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


class SamplingIn(NullIsUnset):
    """SGLang's `sampling_params` (sampling_params.md): unset fields take the server's defaults."""

    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields: logged once, no effect

    max_new_tokens: Count | None = None  # unset: 128, as SGLang
    min_new_tokens: Count | None = None
    temperature: Annotated[Float, Field(ge=0.0, le=100.0)] | None = None  # the engine's bounds
    top_p: Annotated[Float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=I32)] | None = None  # -1: all
    min_p: Annotated[Float, Field(ge=0.0, le=1.0)] | None = None
    frequency_penalty: Annotated[Float, Field(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[Float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[Float, Field(gt=0.0, le=10.0)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False  # a matched stop string stays at the end of the text
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    sampling_seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    json_schema: Any = None  # a schema's JSON text (or object)
    regex: Any = None
    ebnf: Any = None


class GenerateIn(NullIsUnset):
    """SGLang's GenerateReqInput, the fields this server serves (a single `rid`, one
    `sampling_params` for every prompt)."""

    model_config = ConfigDict(strict=True, extra="allow")

    text: str | list[str] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    sampling_params: SamplingIn = Field(default_factory=SamplingIn)
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: Annotated[int, Field(ge=-1, le=I32)] = -1  # -1: no prompt logprobs
    top_logprobs_num: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] = 0
    return_text_in_logprobs: bool = False
    rid: Annotated[str, Field(min_length=1, max_length=MAX_RID)] | None = None
    model: str | None = None  # not SGLang's: which served model, where the router serves several


def parse_body(body: Any) -> GenerateIn:
    """The body checked; a 400 naming the field (nested ones as `sampling_params.temperature`)."""
    try:
        req = GenerateIn.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        if err.get("type") == "model_type" and not err.get("loc"):
            raise bad("the body must be a JSON object with the request's fields") from None
        loc = [str(x) for x in err.get("loc", ()) if not str(x).isdigit()]
        # a union's members show up in loc (`list[int]`, `str`): the field is what precedes them
        loc = [x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int", "list")]
        param = ".".join(loc) or None
        got = "" if err.get("type") == "missing" else f" (got {err.get('input')!r})"[:200]
        raise bad(f"'{param}': {err.get('msg', 'invalid')}{got}", param) from None
    for where, extra, refused in (
        ("", req.model_extra or {}, _REFUSED),
        ("sampling_params.", req.sampling_params.model_extra or {}, _REFUSED_SAMPLING),
    ):
        for name in refused:
            if extra.get(name) is not None:
                raise bad(f"'{where}{name}' is not supported by this server's /generate", where + name)
        ignored = {k: v for k, v in extra.items() if v is not None}  # null: as if not sent
        if ignored:
            note_ignored(f"{ROUTE} {where.rstrip('.')}".rstrip(), ignored)
    return req


def prompts_of(req: GenerateIn) -> tuple[list[str | list[int]], bool]:
    """The prompts, and whether the body sent a batch (a list answer)."""
    if (req.text is None) == (req.input_ids is None):
        raise bad("send one of 'text' or 'input_ids'", "text" if req.text is not None else "input_ids")
    if isinstance(req.text, str):
        if not req.text:
            raise bad("'text' is empty", "text")
        return [req.text], False
    if req.text is not None:
        ps: list = req.text
        field = "text"
        ok = all(isinstance(p, str) and p for p in ps)
    elif req.input_ids and isinstance(req.input_ids[0], int):
        return [list(req.input_ids)], False  # type: ignore[arg-type]
    else:
        ps, field = req.input_ids or [], "input_ids"
        ok = all(isinstance(p, list) and p for p in ps)
    if not ps or len(ps) > MAX_BATCH or not ok:
        raise bad(f"'{field}' must be one non-empty prompt or a list of 1 to {MAX_BATCH} non-empty prompts", field)
    return list(ps), True


def sampling(sp_in: SamplingIn) -> pb.SamplingParams:
    """SGLang's sampling_params as the engine's SamplingParams (server defaults fill the rest)."""
    s = sp_in
    sp = pb.SamplingParams(top_k=-1 if s.top_k == 0 else s.top_k or 0, ignore_eos=s.ignore_eos)
    sp.max_tokens = max(1, DEFAULT_MAX_NEW_TOKENS if s.max_new_tokens is None else s.max_new_tokens)
    given = {name: getattr(s, name) for name in _SAME_NAMES} | {"min_tokens": s.min_new_tokens}
    for name, v in given.items():
        if v is not None:
            setattr(sp, name, v)
    if s.sampling_seed is not None:
        sp.seed = seed_of(s.sampling_seed)
    stops = [s.stop] if isinstance(s.stop, str) else list(s.stop or ())
    try:
        check_stops(stops)
    except ValueError as e:  # its message opens with `stop`
        raise bad(f"sampling_params.{e}", "sampling_params.stop") from None
    sp.stop.extend(stops)
    sp.stop_token_ids.extend(s.stop_token_ids or ())
    sp.include_stop_str_in_output = s.no_stop_trim
    if not s.skip_special_tokens:
        sp.skip_special_tokens = False
    c = _constraint(s)
    if c is not None:
        sp.constraint.CopyFrom(c)
    return sp


def _constraint(s: SamplingIn) -> pb.Constraint | None:
    """json_schema / regex / ebnf: the same constraint the OpenAI routes build from SGLang's fields."""
    view = SimpleNamespace(
        response_format=None,
        format_field="response_format",
        structured_outputs=None,
        guided_whitespace_pattern=None,
        guided_decoding_backend=None,
        special_tokens={},  # only a structural tag reads them: SGLang's fields here are none
        **{name: None for name, _ in structured_fields.TOP_LEVEL},
    )
    view.json_schema, view.regex, view.ebnf = s.json_schema, s.regex, s.ebnf
    try:
        return structured_fields.constraint(view)
    except ApiError as e:
        if e.param in ("json_schema", "regex", "ebnf"):
            e.message = e.message.replace(f"'{e.param}'", f"'sampling_params.{e.param}'", 1)
            e.param = f"sampling_params.{e.param}"
        raise


class Output:
    """One output's text, tokens and logprobs so far, shaped as SGLang's answer."""

    def __init__(self, gen: Generation, index: int):
        self.gen, self.index = gen, index
        self.req = gen.job.reqs[index]
        self.text: list[str] = []
        self.ids: list[int] = []
        self.lps: list[pb.TokenLogprob] = []
        self.prompt_ids: list[int] = []
        self.prompt_lps: list[pb.TokenLogprob] = []
        self.prompt_tokens = self.cached_tokens = 0
        self.finish, self.stop = "", ""

    def add(self, c: Chunk) -> None:
        if c.first:
            self.prompt_tokens, self.cached_tokens = c.prompt_tokens, c.cached_tokens
            self.prompt_ids, self.prompt_lps = list(c.prompt_token_ids), list(c.prompt_logprobs)
        self.text.append(c.text)
        self.ids += c.token_ids
        self.lps += c.logprobs
        self.finish, self.stop = c.finish_reason or self.finish, c.stop or self.stop

    def _entry(self, token_id: int, logprob: float | None) -> list:
        text = self.gen.token_text(token_id) if self.gen.want_text else None
        return [None if logprob is None else max(logprob, -9999.0), token_id, text]

    def _finish_reason(self) -> dict | None:
        if not self.finish:
            return None
        if self.finish == "length":
            return {"type": "length", "length": len(self.ids)}
        if self.finish == "stop":  # a stop string, else the token that ended it (EOS or a stop id)
            return {"type": "stop", "matched": self.stop or (self.ids[-1] if self.ids else None)}
        return {"type": "abort", "message": self.finish}

    def answer(self) -> dict:
        g = self.gen
        meta: dict[str, Any] = {
            "id": g.ids[self.index],
            "finish_reason": self._finish_reason(),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.ids),
            "cached_tokens": self.cached_tokens,
        }
        if g.req.return_logprob:
            meta["output_token_logprobs"] = [self._entry(e.token_id, e.logprob) for e in self.lps]
            start = g.req.logprob_start_len
            plps = self.prompt_lps  # prompt tokens 1..n-1
            meta["input_token_logprobs"] = [
                self._entry(t, None if p == 0 else plps[p - 1].logprob)
                for p, t in enumerate(self.prompt_ids)
                if 0 <= start <= p and (p == 0 or p - 1 < len(plps))
            ]
            if g.req.top_logprobs_num:
                meta["output_top_logprobs"] = [[self._entry(t.token_id, t.logprob) for t in e.top] for e in self.lps]
                meta["input_top_logprobs"] = [
                    None if p == 0 else [self._entry(t.token_id, t.logprob) for t in plps[p - 1].top]
                    for p in range(len(self.prompt_ids))
                    if 0 <= start <= p and (p == 0 or p - 1 < len(plps))
                ]
        if self.finish:
            meta["e2e_latency"] = time.monotonic() - g.started
        return {"text": "".join(self.text), "output_ids": list(self.ids), "meta_info": meta}


class Generation:
    """One /generate body: a GenerateRequest per prompt and sample (prompt-major), as a Job the
    OpenAI front runs (its admission, disconnect handling and errors)."""

    def __init__(self, front: Any, req: GenerateIn):
        self.front, self.req, self.started = front, req, time.monotonic()
        self.want_text = req.return_text_in_logprobs
        self.skip = req.sampling_params.skip_special_tokens
        self.job: Job
        self.ids: list[str] = []
        self.batch = False

    def token_text(self, token_id: int) -> str:
        return self.front.tok.decode([token_id], self.skip)

    async def build(self) -> None:
        req, front = self.req, self.front
        model = front.model(req.model)
        ps, self.batch = prompts_of(req)
        sp = sampling(req.sampling_params)
        if req.return_logprob:
            if front.tok is None and self.want_text:
                raise bad("return_text_in_logprobs needs a tokenizer on the router", "return_text_in_logprobs")
            sp.logprobs = req.top_logprobs_num
            if req.logprob_start_len >= 0:
                sp.prompt_logprobs = req.top_logprobs_num
        n = req.sampling_params.n
        self.batch = self.batch or n > 1
        check_expansion(len(ps), n, front.service.expansion_limit())
        rid = req.rid or uuid.uuid4().hex
        self.job = Job(model, False, rid, n, False, sp.logprobs if sp.HasField("logprobs") else None)
        suffix = uuid.uuid4().hex[:8]  # the nodes' ids stay unique when a client sends a rid twice
        for j, p in enumerate(ps):
            if req.return_logprob and req.logprob_start_len >= 0:
                if isinstance(p, str):  # the prompt's ids, to check the start against
                    p = await front.service.encode(p)
                if req.logprob_start_len >= len(p):
                    raise bad(
                        f"'logprob_start_len' {req.logprob_start_len} is not within the prompt's {len(p)} tokens "
                        "(-1: no prompt logprobs)",
                        "logprob_start_len",
                    )
            for i in range(n):
                k = j * n + i
                r = pb.GenerateRequest(sampling=sp)
                if isinstance(p, str):
                    r.prompt = p
                else:
                    r.prompt_token_ids.extend(p)
                one = len(ps) * n == 1
                r.request_id = (f"{rid}-{suffix}" if req.rid else rid) + ("" if one else f"-{k}")
                if sp.HasField("seed"):
                    r.sampling.seed = seed_of(sp.seed, i)
                self.job.reqs.append(r)
                self.ids.append(rid if one else f"{rid}-{k}")

    def outputs(self) -> list[Output]:
        return [Output(self, i) for i in range(len(self.job.reqs))]

    def shaped(self, answers: list[dict]) -> Any:
        return answers if self.batch else answers[0]


def _json(status: int, obj: Any) -> Response:
    return Response(json.dumps(obj), status, media_type="application/json")


async def whole(gen: Generation) -> Response:
    outs = gen.outputs()
    async with aclosing(gen.front.events(gen.job)) as ev:
        async for i, c in ev:
            outs[i].add(c)
    return _json(200, gen.shaped([o.answer() for o in outs]))


async def stream(gen: Generation, request: Request) -> Response:
    """SGLang's stream: an event per chunk with the output so far (cumulative text, ids and
    logprobs; `index` where the body asked for several), then `data: [DONE]`. An error before the
    first chunk is an HTTP status; after it, an error event and the end."""
    ev = await gen.front.opened(gen.job, request)
    outs = gen.outputs()

    async def body() -> AsyncIterator[bytes]:
        try:
            async for i, c in ev:
                outs[i].add(c)
                out = outs[i].answer()
                if gen.batch:
                    out["index"] = i
                yield b"data: " + json.dumps(out).encode() + b"\n\n"
        except Abort as a:
            yield b"data: " + json.dumps(ApiError.from_status(a.code, a.msg).body()).encode() + b"\n\n"
        finally:
            await ev.aclose()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def register(app: FastAPI, front: Any, limit: int, hints, until_disconnect, gone: type[Exception]) -> None:
    """`POST /generate` on `app`, over the OpenAI front `front`."""

    @app.post(ROUTE)
    async def generate(request: Request):
        hints(request)
        gen = Generation(front, parse_body(await read_json(request, limit)))
        await gen.build()
        try:
            if gen.req.stream:
                return await stream(gen, request)
            return await until_disconnect(request, whole(gen))
        except gone:
            return Response(status_code=499)

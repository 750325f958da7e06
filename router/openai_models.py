"""The OpenAI request bodies as strict pydantic models, their mapping onto SamplingParams
(`sampling`), and OpenAI's error shape; a bad field is a 400 naming it (docs/api.md)."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

import grpc
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from proto import pb
from router.stops import check_stops

log = logging.getLogger("pdserve.http")

MAX_LOGIT_BIAS = 300  # most logit_bias entries (OpenAI's limit; the engine's too)
MAX_N = 16  # most choices per request
MAX_BATCH = 64  # most prompts in one completions request
MAX_CACHE_SALT = 1024  # characters (the engine's limit too)
SEEDS = 2**63  # the engine's seeds are [0, 2^63): a body's (any int64, as vLLM) is taken modulo this

_HTTP_OF = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


class ApiError(Exception):
    retry_after_s: float | None = None  # a refusal at admission: its estimated wait (Retry-After)

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def from_status(cls, code: grpc.StatusCode, message: str) -> ApiError:
        status, typ = _HTTP_OF.get(code, (500, "internal_error"))
        param = None
        if code == grpc.StatusCode.INVALID_ARGUMENT:  # the engine's messages open with the field's name
            m = re.match(r"[a-z_]+", message or "")
            param = m.group(0) if m and m.group(0) in _Request.model_fields else None
            part = re.match(r"((?:messages|input|images)\[\d+\](?:\.[a-z_]+\[\d+\])*): ", message or "")
            param = part.group(1) if part else param  # an image part's refusal names the part
        return cls(status, message or code.name, typ, param, code.name.lower())

    @classmethod
    def from_abort(cls, a) -> ApiError:
        e = cls.from_status(a.code, a.msg)
        e.retry_after_s = a.retry_after_s
        return e

    @classmethod
    def from_rpc(cls, e: grpc.RpcError) -> ApiError:
        return cls.from_status(e.code(), e.details())


def bad(msg: str, param: str | None = None) -> ApiError:
    return ApiError(400, msg, "invalid_request_error", param)


def from_validation(errors: list[dict]) -> ApiError:
    """pydantic's errors (FastAPI's, with "body" first in `loc`) -> one 400 naming the field."""
    e = errors[0]
    loc = [x for x in e.get("loc", ()) if x != "body"]
    if e.get("type") == "json_invalid":
        return bad(f"the body is not JSON: {e.get('msg')}")
    if not loc or not isinstance(loc[0], str):
        return bad("the body must be a JSON object with the request's fields")
    param = loc[0]
    got = e.get("input")
    shown = "" if e.get("type") == "missing" else f" (got {got!r})"[:200]
    return bad(f"'{param}': {e.get('msg', 'invalid')}{shown}", param)


def parse(model: type[BaseModel], body: Any) -> BaseModel:
    """Validate a decoded body; ApiError 400 on failure. The fields a request model does not
    know (it keeps them: extra="allow") have no effect; each is logged once (`note_ignored`)."""
    try:
        out = model.model_validate(body)
    except ValidationError as e:
        raise from_validation(e.errors()) from None
    if out.model_extra:
        note_ignored(getattr(model, "ROUTE", model.__name__), out.model_extra)
    return out


_NOTED: set[str] = set()
MAX_NOTED = 256  # field names remembered (a client sending random names cannot grow it further)


def note_ignored(route: str, fields: dict[str, Any]) -> None:
    """A WARNING the first time a route receives a field it does not know, so an operator learns
    which of the clients' options have no effect here (once per process and field, not per request)."""
    for name in sorted(fields):
        key = f"{route} {name}"
        if key not in _NOTED and len(_NOTED) < MAX_NOTED:
            _NOTED.add(key)
            log.warning("%s: request field %r is not supported here and is ignored (logged once)", route, name)


Float = Annotated[float, Field(allow_inf_nan=False)]
I32 = 2**31 - 1  # the wire's int32 fields: larger values are refused here, not by the encoder (a 500)
Count = Annotated[int, Field(ge=0, le=I32)]
TokenIds = list[Count]


class NullIsUnset(BaseModel):
    """A field sent as JSON null is as if not sent (its default): OpenAI types its optional fields
    "or null", and clients' serializers send null for what they leave unset."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(v is None for v in data.values()):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data


def seed_of(seed: int, i: int = 0) -> int:
    """Choice i's seed for a body's `seed`: seed + i, wrapped into the engine's range."""
    return (seed + i) % SEEDS


class StreamOptions(NullIsUnset):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class _Request(NullIsUnset):
    """What completions and chat completions share."""

    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields: logged once, no effect (`parse`)

    model: Annotated[str, Field(min_length=1)] | None = None  # unset: the one model served (as vLLM)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    temperature: Annotated[Float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Float, Field(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=I32)] | None = None
    min_p: Annotated[Float, Field(ge=0.0, le=1.0)] | None = None  # an extension, as vLLM's
    presence_penalty: Annotated[Float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[Float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[Float, Field(ge=0.0, le=10.0)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None  # any int64: `seed_of`
    min_tokens: Count | None = None
    num_speculative_tokens: Count | None = None  # at most the nodes' own
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    best_of: int | None = None
    stop: str | list[str | Annotated[int, Field(ge=-(2**31), le=I32)]] | None = None  # ints: token ids (an extension)
    stop_token_ids: list[Annotated[int, Field(ge=-(2**31), le=I32)]] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    logit_bias: Any = None  # {"token id": bias}: checked in `sampling` (_logit_bias)
    # refused by name unless empty / the default
    suffix: Any = None
    tools: Any = None
    functions: Any = None
    tool_choice: Any = None
    function_call: Any = None
    response_format: Any = None
    # the structured-output fields other engines' clients send (router/structured_fields.py)
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None  # one backend; its `:disable-any-whitespace` style options are read
    guided_whitespace_pattern: Any = None  # the JSON whitespace of guided_json (router/json_shape.py)
    regex: Any = None
    ebnf: Any = None
    json_schema: Any = None  # SGLang's: a schema's JSON text (or object)
    # vLLM's output extensions
    include_stop_str_in_output: bool = False  # a matched stop string stays at the end of the text
    skip_special_tokens: bool = True  # false: special tokens (<|im_end|>) are in the text too
    return_token_ids: bool | None = None  # prompt_token_ids and each choice's token_ids in the answer
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens "token_id:N"
    # the admission class: vLLM's integer priority (above 0: batch, else interactive) or the name;
    # the x-pdserve-priority header wins, and an API key's class caps it (router/service.py)
    priority: Annotated[int, Field(ge=-(2**31), le=I32)] | Literal["interactive", "batch"] | None = None
    # prefix-cache isolation: shares cached prompt state only with requests of the same salt
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT)] | None = None
    # vLLM's, refused by name unless empty / the default (an ignored one would change the answer unseen)
    use_beam_search: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    # per-request image processor pixel bounds: min_pixels, max_pixels, size (router/images/size_kwargs.py)
    mm_processor_kwargs: Any = None
    media_io_kwargs: Any = None  # per-request image decoding options (rgba_background_color, ...)
    # vLLM's: the model sees only the prompt's last N tokens (-1: max_model_len); router/prompt_truncation.py
    truncate_prompt_tokens: Annotated[int, Field(ge=-(2**31), le=I32)] | None = None
    # vLLM's: per prompt token after the first, its logprob and rank and the N most likely (chat: over
    # the rendered prompt, at the answer's top level)
    prompt_logprobs: Any = None
    # where `response_format` is in the body the client sent (Responses' `text.format`, Anthropic's
    # `output_config.format`): error messages name what the client wrote
    _format_field: str = PrivateAttr(default="response_format")

    @property
    def format_field(self) -> str:
        return self._format_field

    def name_format(self, field: str) -> None:
        """Name `response_format` `field` in errors (a body converted to chat)."""
        self._format_field = field

    # the checkpoint's added tokens' texts, which a structural tag's strings may be (struct_tag.py)
    _special_tokens: Mapping[str, int] = PrivateAttr(default_factory=dict)

    @property
    def special_tokens(self) -> Mapping[str, int]:
        return self._special_tokens

    def know_special_tokens(self, ids: Mapping[str, int]) -> None:
        self._special_tokens = ids

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options is not None and self.stream_options.continuous_usage_stats

    @property
    def no_output(self) -> bool:
        """max_tokens 0: the one token generated is not returned."""
        mt = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return mt == 0


class CompletionRequest(_Request):
    ROUTE: ClassVar[str] = "/v1/completions"
    # a string, token ids, or a batch of up to MAX_BATCH of either (checked in `prompts`)
    prompt: str | list[int] | list[str | list[int]]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | bool | None = None


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None  # None: an assistant turn of tool calls only


class ChatRequest(_Request):
    ROUTE: ClassVar[str] = "/v1/chat/completions"
    messages: Annotated[list[Message], Field(min_length=1)]
    logprobs: bool = False
    echo: bool = False  # vLLM's: the last message's text before each choice's content (router/openai_chat.py)
    # the chat template's inputs (router/chat_template.py); tools and tool_choice: router/tool_choice.py
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: Any = None  # vLLM's per-request template: refused (an ignored one would change the prompt)
    enable_thinking: bool | None = None  # as Qwen's own API takes it; chat_template_kwargs' wins
    # vLLM's: at most this many tokens of thinking, then </think> is forced (router/thinking_budget.py)
    thinking_token_budget: Count | None = None
    # OpenAI's: passed to the template as `reasoning_effort`; "none" is enable_thinking false too
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @property
    def adds_generation_prompt(self) -> bool:
        """add_generation_prompt as sent; unsent, the opposite of continue_final_message (vLLM refuses both true)."""
        return (
            self.add_generation_prompt
            if "add_generation_prompt" in self.model_fields_set
            else not self.continue_final_message
        )

    parallel_tool_calls: bool | None = None  # None: true, as OpenAI
    # (message, part) -> the part's name in the body the client sent, where that was not a chat
    # request (router/responses_request.py): error messages name what the client wrote
    _part_names: dict[tuple[int, int], str] = PrivateAttr(default_factory=dict)
    # tool i's parameter schema, named as the client's body has it (Anthropic's `tools[{i}].input_schema`)
    _schema_field: str = PrivateAttr(default="tools[{i}].function.parameters")

    @property
    def part_names(self) -> dict[tuple[int, int], str]:
        return self._part_names

    def schema_field(self, i: int) -> str:
        """Where tool i's parameter schema is in the body the client sent."""
        return self._schema_field.format(i=i)

    def name_schemas(self, field: str) -> None:
        """Name tool i's schema `field.format(i=i)` in errors (a body converted to chat)."""
        self._schema_field = field

    def text_chars(self) -> int:
        """Characters of the messages' text (image parts' URLs not counted: they are no prompt text)."""
        n = 0
        for m in self.messages:
            if isinstance(m.content, str):
                n += len(m.content)
            elif m.content is not None:
                n += sum(len(str(p.get("text", ""))) for p in m.content)
        return n


def prompts(req: CompletionRequest) -> list[str | list[int]]:
    """`prompt`: a string, a list of token ids, or a batch (list) of either."""
    p = req.prompt

    def ids(x) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and 0 <= t <= I32 for t in x)

    if (isinstance(p, str) and p) or ids(p):
        return [p]
    if isinstance(p, list) and 0 < len(p) <= MAX_BATCH and all((isinstance(x, str) and x) or ids(x) for x in p):
        return p
    raise bad(
        f"'prompt' must be a non-empty string, a list of token ids (integers in [0, 2^31)), or a list of up to "
        f"{MAX_BATCH} of either",
        "prompt",
    )


# other engines' request fields that would change the answer, and what to send instead
UNSUPPORTED_EXTENSIONS = {
    "use_beam_search": "",
    "allowed_token_ids": " (a 'structured_outputs' choice or regex constrains the output)",
    "bad_words": " ('logit_bias' of -100 bans a token)",
    "media_io_kwargs": " (images are decoded as RGB, transparency on white)",
}


def _refuse_unsupported(req: _Request) -> None:
    chat = isinstance(req, ChatRequest)  # chat takes tools, tool_choice and response_format
    for name in ("suffix", "functions") if chat else ("suffix", "tools", "functions"):
        if getattr(req, name) not in (None, {}, []):
            raise bad(f"'{name}' is not supported" + ("" if chat else " for completions"), name)
    for name in ("function_call",) if chat else ("tool_choice", "function_call"):
        if getattr(req, name) not in (None, "none", "auto"):
            raise bad(f"'{name}' is not supported (no tools)", name)
    if chat and req.chat_template not in (None, ""):
        raise bad(
            "'chat_template' in a request is not supported: the model's own template renders the messages "
            "(the router's --chat-template sets another for every request)",
            "chat_template",
        )
    if req.best_of not in (None, req.n):
        raise bad("best_of other than n is not supported", "best_of")
    for name, hint in UNSUPPORTED_EXTENSIONS.items():
        v = getattr(req, name)  # unset, false or empty: as if not sent
        if v is not None and v is not False and v != [] and v != {}:
            raise bad(f"'{name}' is not supported{hint}", name)


def _logit_bias(bias: Any) -> dict[int, float]:
    """OpenAI's `logit_bias`: an object from token ids (as strings) to numbers in [-100, 100]."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise bad(
            f"'logit_bias' must be an object mapping token ids to biases (got {type(bias).__name__})", "logit_bias"
        )
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad(f"'logit_bias' has {len(bias)} entries; at most {MAX_LOGIT_BIAS}", "logit_bias")
    out = {}
    for k, v in bias.items():
        if not re.fullmatch(r"[0-9]{1,10}", k) or int(k) >= 2**31:
            raise bad(f"'logit_bias' keys must be token ids, non-negative integers (got {k!r})", "logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not -100 <= v <= 100:
            raise bad(f"'logit_bias' values must be numbers in [-100, 100] (got {v!r} for token {k})", "logit_bias")
        if int(k) in out:
            raise bad(f"'logit_bias' names token {int(k)} more than once", "logit_bias")
        out[int(k)] = float(v)
    return out


def _prompt_logprobs(req: CompletionRequest | ChatRequest) -> int | None:
    """vLLM's `prompt_logprobs` (0 is a value: the prompt's tokens alone), checked."""
    k = req.prompt_logprobs
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 20):
        raise bad(
            f"'prompt_logprobs' takes the number of alternatives per prompt token, 0 to 20 (got {k!r})",
            "prompt_logprobs",
        )
    return k


def sampling(req: CompletionRequest | ChatRequest) -> pb.SamplingParams:
    """The request's SamplingParams; the engine checks the rest (INVALID_ARGUMENT -> 400)."""
    _refuse_unsupported(req)
    chat = isinstance(req, ChatRequest)
    # top_k 0 on the wire is unset (the server's default applies: router/sampling_defaults.py); a
    # client's own 0 means off, as -1 does
    sp = pb.SamplingParams(top_k=-1 if req.top_k == 0 else req.top_k or 0, ignore_eos=req.ignore_eos)
    mt = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if mt is not None:
        sp.max_tokens = max(mt, 1)  # 0: generate one token and return none (prompt logprobs only)
    elif chat:  # OpenAI's chat default: as many as the context leaves (the nodes stop at max_model_len)
        sp.max_tokens = I32
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
        "num_speculative_tokens",
    ):
        v = getattr(req, name)
        if v is not None:
            setattr(sp, name, v)
    if req.seed is not None:
        sp.seed = seed_of(req.seed)
    stop = [] if req.stop is None else [req.stop] if isinstance(req.stop, str) else req.stop
    strings = [t for t in stop if isinstance(t, str)]
    try:
        check_stops(strings)
    except ValueError as e:
        raise bad(str(e), "stop") from None
    sp.stop.extend(strings)
    ids = [t for t in stop if isinstance(t, int)] + list(req.stop_token_ids or ())
    if any(t < 0 for t in ids):
        raise bad(f"stop token ids must be non-negative integers (got {ids!r})", "stop_token_ids")
    sp.stop_token_ids.extend(ids)
    sp.include_stop_str_in_output = req.include_stop_str_in_output
    sp.cache_salt = req.cache_salt or ""
    if not req.skip_special_tokens:
        sp.skip_special_tokens = False
    for t, b in _logit_bias(req.logit_bias).items():
        sp.logit_bias[t] = b
    k = _prompt_logprobs(req)
    if chat:
        if req.logprobs:
            sp.logprobs = req.top_logprobs or 0
        elif req.top_logprobs is not None:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if k is not None:  # over the rendered prompt; the whole answer carries them (not a stream, as vLLM)
            if req.stream:
                raise bad("'prompt_logprobs' is not available with 'stream' on chat completions", "prompt_logprobs")
            sp.prompt_logprobs = k
        return sp
    if req.top_logprobs is not None:
        raise bad("'top_logprobs' is a chat option; completions take 'logprobs': N", "top_logprobs")
    if req.logprobs is True:
        raise bad("'logprobs' takes the number of alternatives per token, 0 to 20 (got true)", "logprobs")
    if req.logprobs is not None and req.logprobs is not False:
        sp.logprobs = req.logprobs
    if req.echo and sp.HasField("logprobs"):  # the prompt's entries come first
        k = max(sp.logprobs, -1 if k is None else k)
    if k is not None:
        sp.prompt_logprobs = k
    return sp

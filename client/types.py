"""What the SDK returns, and how a request is put on the wire (shared by Client and AsyncClient)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from client import args
from proto import pb
from proto.convert import constraint_pb


class PdserveError(Exception):
    """A failed call: `code` is the grpc.StatusCode, `message` the server's explanation."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s  # a refusal at admission: the router's estimated wait

    @classmethod
    def from_rpc(cls, e: grpc.RpcError) -> PdserveError:
        code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
        details = e.details() if callable(getattr(e, "details", None)) else str(e)
        md = e.trailing_metadata() if callable(getattr(e, "trailing_metadata", None)) else None
        after = next((v for k, v in md or () if k == "pdserve-retry-after-s"), None)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "", float(after) if after is not None else None)


@dataclass
class StreamChunk:
    request_id: str
    token_ids: list[int]  # new tokens in this chunk
    text: str  # their text (empty without a tokenizer on the router)
    finish_reason: str | None  # None while running; "stop" | "length" | "abort" on the last chunk
    timings: pb.Timings
    prompt_tokens: int = 0  # set on the first chunk
    cached_tokens: int = 0  # first chunk: prompt tokens taken from a node's prefix cache
    decode_node: str = ""  # set on the first chunk
    prefill_node: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token_ids entry (logprobs=)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # first chunk: prompt tokens 1..n-1


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass
class GenerateResult:
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens taken from a node's prefix cache
    decode_node: str = ""
    prefill_node: str = ""
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    e2e_s: float = 0.0
    queue_s: float = 0.0
    transfer_s: float = 0.0
    transfer_bytes: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, c: StreamChunk) -> None:
        self.request_id = c.request_id
        self.token_ids.extend(c.token_ids)
        self.logprobs.extend(c.logprobs)
        self.prompt_logprobs.extend(c.prompt_logprobs)
        self.text += c.text
        if c.prompt_tokens:
            self.prompt_tokens, self.decode_node, self.prefill_node = c.prompt_tokens, c.decode_node, c.prefill_node
            self.cached_tokens = c.cached_tokens
        t = c.timings
        self.ttft_s = t.ttft_s or self.ttft_s
        self.queue_s = t.queue_s or self.queue_s
        if c.finish_reason:
            self.finish_reason = c.finish_reason
            self.tpot_s, self.e2e_s = t.tpot_s, t.e2e_s
            self.transfer_s, self.transfer_bytes = t.transfer_s, t.transfer_bytes


def chunk_from(m: pb.GenerateResponse) -> StreamChunk:
    return StreamChunk(
        request_id=m.request_id,
        token_ids=list(m.token_ids),
        text=m.text,
        finish_reason=m.finish_reason or None,
        timings=m.timings,
        prompt_tokens=m.prompt_tokens,
        cached_tokens=m.cached_tokens,
        decode_node=m.decode_node,
        prefill_node=m.prefill_node,
        logprobs=_logprobs(m.logprobs),
        prompt_logprobs=_logprobs(m.prompt_logprobs),
    )


def chunk_from_delta(d: pb.TokenDelta) -> StreamChunk:
    """A chunk that came on the client's token stream (client/mux.py)."""
    return StreamChunk(
        request_id=d.request_id,
        token_ids=list(d.token_ids),
        text=d.text,
        finish_reason=None,
        timings=pb.Timings(),  # none on a token stream: the call's last message has them
        logprobs=_logprobs(d.logprobs),
    )


def _logprobs(entries) -> list[TokenLogprob]:
    return [TokenLogprob(e.token_id, e.logprob, [(t.token_id, t.logprob) for t in e.top]) for e in entries]


def _constraint(c: pb.Constraint | dict) -> pb.Constraint:
    """A pb.Constraint, or {"kind": ..., "value": ..., "start_after_token": ...} with kind one of
    json_schema (value: the schema, a dict or JSON text), json_object, regex, grammar, choice
    (value: a list of strings)."""
    if isinstance(c, pb.Constraint):
        return c
    if not isinstance(c, dict) or "kind" not in c:
        raise ValueError("constraint must be a pb.Constraint or a dict with a 'kind'")
    value = c.get("value", "")
    if c["kind"] == "json_schema" and isinstance(value, dict):
        value = json.dumps(value)
    return constraint_pb(c["kind"], value, c.get("start_after_token"))


def build_request(
    prompt: str | None = None,
    prompt_token_ids=None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int = 0,
    top_p: float | None = None,
    seed: int | None = None,
    stop_token_ids=(),
    ignore_eos: bool = False,
    request_id: str | None = None,
    stop: str | list[str] = (),
    min_tokens: int = 0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float | None = None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    num_speculative_tokens: int | None = None,
    logit_bias: dict[int, float] | None = None,
    min_p: float | None = None,
    constraint: pb.Constraint | dict | None = None,
    admission_timeout_s: float | None = None,
    priority: str | None = None,
    images: Sequence[bytes | str | os.PathLike[str]] | bytes | str | os.PathLike[str] = (),
    include_stop_str_in_output: bool = False,
    skip_special_tokens: bool | None = None,
    cache_salt: str = "",
    mm_processor_kwargs: dict | None = None,
) -> pb.GenerateRequest:
    """Unset options (None) take the server's defaults. docs/api.md describes each. `images`: the
    prompt's, in order, each encoded bytes, a file path or a URL (data:, or http(s) for a router
    started with --allow-image-urls), or one such image alone; the prompt holds IMAGE_PLACEHOLDER
    once per image; `mm_processor_kwargs`: vLLM's image pixel bounds, {"min_pixels": N,
    "max_pixels": N} or {"size": {"shortest_edge": N, "longest_edge": N}}. A badly typed argument raises TypeError (a value the wire cannot carry,
    ValueError) naming it (client/args.py); the router checks the ranges (INVALID_ARGUMENT)."""
    if (prompt is None) == (prompt_token_ids is None):
        raise ValueError("give exactly one of prompt= (text) or prompt_token_ids=")
    if prompt is not None and not isinstance(prompt, str):
        what = "; token ids go in prompt_token_ids=" if not isinstance(prompt, (bytes, bytearray)) else ""
        raise TypeError(f"prompt must be a str (text), not {type(prompt).__name__}{what}")
    sp = pb.SamplingParams(
        top_k=args.integer("top_k", _or(top_k, 0)),
        stop_token_ids=args.token_ids("stop_token_ids", _or(stop_token_ids, ())),
        ignore_eos=args.flag("ignore_eos", _or(ignore_eos, False)),
        stop=args.strings("stop", _or(stop, ())),
        min_tokens=args.integer("min_tokens", _or(min_tokens, 0)),
        presence_penalty=args.number("presence_penalty", _or(presence_penalty, 0.0)),
        frequency_penalty=args.number("frequency_penalty", _or(frequency_penalty, 0.0)),
        include_stop_str_in_output=args.flag("include_stop_str_in_output", _or(include_stop_str_in_output, False)),
        cache_salt=args.text("cache_salt", _or(cache_salt, "")),  # cached prompt state shared only within a salt
    )
    for name, v, check in (
        ("max_tokens", max_tokens, args.integer),
        ("temperature", temperature, args.number),
        ("top_p", top_p, args.number),
        ("seed", seed, lambda n, v: args.integer(n, v, args.I64)),
        ("repetition_penalty", repetition_penalty, args.number),
        ("logprobs", logprobs, args.integer),
        ("prompt_logprobs", prompt_logprobs, args.integer),
        ("num_speculative_tokens", num_speculative_tokens, args.integer),
        ("min_p", min_p, args.number),
        ("skip_special_tokens", skip_special_tokens, args.flag),
    ):
        if v is not None:
            setattr(sp, name, check(name, v))
    if logit_bias is not None:  # token id -> bias in [-100, 100]
        for t, b in args.logit_bias(logit_bias).items():
            sp.logit_bias[t] = b
    if constraint is not None:
        sp.constraint.CopyFrom(_constraint(constraint))
    req = pb.GenerateRequest(request_id=args.text("request_id", _or(request_id, "")), sampling=sp)
    if admission_timeout_s is not None:  # the longest wait to start (0: no limit); else the router's default
        req.admission_timeout_s = args.number("admission_timeout_s", admission_timeout_s)
    if priority is not None:  # "interactive" (the default) or "batch"
        req.priority = _priority(priority)
    if prompt is not None:
        req.prompt = prompt
    else:
        req.prompt_token_ids.extend(args.token_ids("prompt_token_ids", prompt_token_ids))
    req.images.extend(image_part(x, f"images[{i}]") for i, x in enumerate(args.images(_or(images, ()))))
    if mm_processor_kwargs:
        req.image_size.CopyFrom(_image_size(mm_processor_kwargs))
    return req


_SIZE_KEYS = {"min_pixels": "min_pixels", "max_pixels": "max_pixels"}
_EDGES = {"shortest_edge": "min_pixels", "longest_edge": "max_pixels"}


def _image_size(kw: object) -> pb.ImageSize:
    """mm_processor_kwargs as GenerateRequest.image_size: min_pixels / max_pixels, or transformers'
    size {shortest_edge, longest_edge} (min_pixels / max_pixels win, as in the processor)."""
    if not isinstance(kw, dict):
        raise TypeError(f"mm_processor_kwargs must be a dict, not {type(kw).__name__}")
    out = pb.ImageSize()
    for key, v in kw.items():
        if key == "size":
            if not isinstance(v, dict) or set(v) != set(_EDGES):
                raise ValueError("mm_processor_kwargs size must be a dict with exactly shortest_edge and longest_edge")
            for edge, field in _EDGES.items():
                if not out.HasField(field):
                    setattr(out, field, args.integer(f"mm_processor_kwargs size.{edge}", v[edge], args.U32))
        elif key in _SIZE_KEYS:
            setattr(out, key, args.integer(f"mm_processor_kwargs {key}", v, args.U32))
        else:
            raise ValueError(
                f"mm_processor_kwargs key {key!r} is not supported: min_pixels, max_pixels or size (the image "
                "processor's pixel bounds)"
            )
    return out


def _or(v, default):
    return default if v is None else v


_PRIORITIES = {"interactive": pb.PRIORITY_INTERACTIVE, "batch": pb.PRIORITY_BATCH}


def _priority(v: object) -> int:
    if not isinstance(v, str):
        raise TypeError(f"priority must be 'interactive' or 'batch', not {type(v).__name__} {v!r}")
    if v not in _PRIORITIES:
        raise ValueError(f"priority must be 'interactive' or 'batch', not {v!r}")
    return _PRIORITIES[v]


# What a text prompt holds per image (Qwen3.5's vision tokens); the router expands each to the image's tokens
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def image_part(x: bytes | str | os.PathLike[str], name: str = "image") -> pb.ImagePart:
    """An ImagePart from encoded bytes, a URL (a str with a scheme: data:, http:, https:) or a file
    path; anything else is a TypeError naming `name`."""
    if isinstance(x, (bytes, bytearray, memoryview)):
        return pb.ImagePart(data=bytes(x))
    if isinstance(x, str) and x.split(":", 1)[0].lower() in ("data", "http", "https"):
        return pb.ImagePart(url=x)
    if not isinstance(x, (str, os.PathLike)):
        raise TypeError(f"{name} must be bytes, a file path or a URL, not {type(x).__name__}")
    return pb.ImagePart(data=Path(x).read_bytes())

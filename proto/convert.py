"""Protobuf messages to and from the engine's records, as plain values (this package imports
nothing else of the project: the callers build their own records from what it returns)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypedDict

from proto import pb


class ConstraintKwargs(TypedDict):
    """The engine's Constraint as a mapping (engine/structured/spec.py)."""

    kind: str
    value: str | tuple[str, ...]
    start_after_token: int | None


class ImageKwargs(TypedDict):
    """The engine's ImageInput as a mapping (engine/vision/inputs.py)."""

    data: bytes
    pixel_hash: bytes
    offset: int
    grid_thw: tuple[int, int, int]
    size_bounds: tuple[int, int] | None  # (min_pixels, max_pixels) the request gave; None: the checkpoint's


def image_kwargs(images: Iterable[pb.ImageInput], need_data: bool = True) -> list[ImageKwargs]:
    """ImageInput messages as mappings; ValueError naming the image for a malformed one."""
    out: list[ImageKwargs] = []
    for k, m in enumerate(images):
        if len(m.grid_thw) != 3:
            raise ValueError(f"images[{k}]: grid_thw needs 3 values (t, h, w), got {len(m.grid_thw)}")
        if len(m.pixel_hash) != 32:
            raise ValueError(f"images[{k}]: pixel_hash must be 32 bytes (SHA-256), got {len(m.pixel_hash)}")
        if need_data and not m.data:
            raise ValueError(f"images[{k}]: no image bytes (data)")
        t, h, w = (int(x) for x in m.grid_thw)
        lo, hi = int(m.min_pixels), int(m.max_pixels)
        if (lo, hi) != (0, 0) and not 1 <= lo <= hi:
            raise ValueError(f"images[{k}]: min_pixels {lo} and max_pixels {hi} need 1 <= min_pixels <= max_pixels")
        out.append(
            ImageKwargs(
                data=bytes(m.data),
                pixel_hash=bytes(m.pixel_hash),
                offset=int(m.offset),
                grid_thw=(t, h, w),
                size_bounds=None if (lo, hi) == (0, 0) else (lo, hi),
            )
        )
    return out


# SamplingParams fields about the output's text, applied by the router (the nodes see token ids only)
ROUTER_FIELDS = frozenset({"stop", "include_stop_str_in_output", "skip_special_tokens"})


class SamplingKwargs(TypedDict, total=False):
    """Keyword arguments of the engine's SamplingParams (named here, not imported)."""

    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    min_tokens: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: dict[int, float]
    logprobs: int
    prompt_logprobs: int
    num_speculative_tokens: int
    constraint: ConstraintKwargs
    priority: int
    cache_salt: str


def sampling_kwargs(sp: pb.SamplingParams) -> SamplingKwargs:
    """Only the fields the caller set, so engine defaults apply to the rest."""
    kw = SamplingKwargs(
        top_k=sp.top_k,
        ignore_eos=sp.ignore_eos,
        stop_token_ids=tuple(sp.stop_token_ids),
        min_tokens=sp.min_tokens,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
    )
    # `optional` fields: set only when present on the wire
    if sp.HasField("max_tokens"):
        kw["max_tokens"] = sp.max_tokens
    if sp.HasField("temperature"):
        kw["temperature"] = float(sp.temperature)
    if sp.HasField("top_p"):
        kw["top_p"] = sp.top_p
    if sp.HasField("min_p"):
        kw["min_p"] = float(sp.min_p)
    if sp.HasField("seed"):
        kw["seed"] = sp.seed
    if sp.HasField("repetition_penalty"):
        kw["repetition_penalty"] = float(sp.repetition_penalty)
    if sp.HasField("logprobs"):
        kw["logprobs"] = sp.logprobs
    if sp.HasField("prompt_logprobs"):
        kw["prompt_logprobs"] = sp.prompt_logprobs
    if sp.HasField("num_speculative_tokens"):
        kw["num_speculative_tokens"] = sp.num_speculative_tokens
    if sp.logit_bias:
        kw["logit_bias"] = dict(sp.logit_bias)
    if sp.HasField("constraint"):
        kw["constraint"] = constraint_kwargs(sp.constraint)
    if sp.cache_salt:
        kw["cache_salt"] = sp.cache_salt
    if sp.priority:  # PRIORITY_INTERACTIVE -> 0, PRIORITY_BATCH -> 1; an unknown value is the engine's to refuse
        kw["priority"] = sp.priority - pb.PRIORITY_INTERACTIVE
    return kw  # ROUTER_FIELDS are the router's: nodes see token ids only


def constraint_kwargs(c: pb.Constraint) -> ConstraintKwargs:
    """pb.Constraint -> {kind, value, start_after_token}; a Constraint without a kind set keeps
    kind "" for the engine to refuse by name."""
    kind = c.WhichOneof("kind") or ""
    value: str | tuple[str, ...] = ""
    if kind == "choice":
        value = tuple(c.choice.choices)
    elif kind in ("json_schema", "regex", "grammar"):
        value = getattr(c, kind)
    start = c.start_after_token if c.HasField("start_after_token") else None
    return ConstraintKwargs(kind=kind, value=value, start_after_token=start)


def constraint_pb(kind: str, value: str | Iterable[str] = "", start_after_token: int | None = None) -> pb.Constraint:
    """(kind, value, start_after_token) -> pb.Constraint; ValueError on an unknown kind."""
    c = pb.Constraint()
    if kind == "choice":
        c.choice.choices.extend([value] if isinstance(value, str) else list(value))
    elif kind == "json_object":
        c.json_object = True
    elif kind in ("json_schema", "regex", "grammar"):
        if not isinstance(value, str):
            raise ValueError(f"a {kind} constraint is a string")
        setattr(c, kind, value)
    else:
        raise ValueError(f"constraint kind must be json_schema, json_object, regex, grammar or choice (got {kind!r})")
    if start_after_token is not None:
        c.start_after_token = start_after_token
    return c


Top = Iterable[tuple[int, float]]


def logprobs_pb(entries: Iterable[tuple[int, float, Top] | tuple[int, float, Top, int]]) -> list[pb.TokenLogprob]:
    """engine TokenLogprob tuples (token, logprob, top) -> their wire form; a PromptLogprob's
    fourth element, the token's rank, becomes `rank`."""
    out = []
    for e in entries:
        top = [pb.TopLogprob(token_id=i, logprob=v) for i, v in e[2]]
        out.append(pb.TokenLogprob(token_id=e[0], logprob=e[1], top=top, rank=e[3] if len(e) == 4 else 0))
    return out

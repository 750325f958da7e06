"""The HTTP front door: an OpenAI request body read under the router's limits before anything else
looks at it (`read_json`). Its size (refused from Content-Length before it is read, or counted
as it arrives), its encoding (UTF-8), its JSON (well formed, nested at most MAX_DEPTH deep) and its
strings (no lone UTF-16 surrogate: nothing downstream can encode one) each get a 400 that names
what was wrong; none of these reaches a route as an exception."""

from __future__ import annotations

import json
import re

from fastapi import Request

from router.openai_models import ApiError

MAX_DEPTH = 64  # nesting of JSON arrays and objects; a request body needs a handful
# an oversized body is read on (and dropped) up to this many times the limit, so that the client,
# still sending, reads the 400 instead of a reset connection; beyond it the connection is closed
_DRAIN_FACTOR = 4

# a \\uD800-\\uDFFF escape: the only way a surrogate gets into a string decoded from strict UTF-8
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _refuse(msg: str, code: str) -> ApiError:
    return ApiError(400, msg, "invalid_request_error", None, code)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, at most `limit` bytes, or a 400 naming the limit (the rest is read and dropped)."""
    declared = request.headers.get("content-length")
    size = int(declared) if declared is not None and declared.isdigit() else None
    parts: list[bytes] = []
    got = 0
    over = size is not None and size > limit
    if size is None or size <= _DRAIN_FACTOR * limit:  # one declared far beyond it is not read at all
        async for chunk in request.stream():
            got += len(chunk)
            if got > limit:
                over = True
            if over:
                parts.clear()  # keep nothing of a body that is refused
                if got > _DRAIN_FACTOR * limit:
                    break
            elif chunk:
                parts.append(chunk)
    if over:
        shown = f"{size:,} bytes" if size is not None else f"more than {limit:,} bytes"
        raise _refuse(f"the request body is {shown}; the limit is {limit:,} bytes (--max-body-bytes)", "body_too_large")
    return b"".join(parts)


def _depth_and_surrogates(doc: object, check_surrogates: bool) -> None:
    """Walk the decoded document without recursion: its depth, and (when the text held a surrogate
    escape) every string and key for a surrogate left unpaired."""
    stack: list[tuple[object, int]] = [(doc, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            if d > MAX_DEPTH:
                raise _refuse(f"the JSON body is nested deeper than {MAX_DEPTH} levels, the limit", "json_too_deep")
            for k, x in v.items():
                if check_surrogates and _SURROGATE.search(k):
                    raise _lone_surrogate(k)
                stack.append((x, d + 1))
        elif isinstance(v, list):
            if d > MAX_DEPTH:
                raise _refuse(f"the JSON body is nested deeper than {MAX_DEPTH} levels, the limit", "json_too_deep")
            stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list, str)))
        elif isinstance(v, str) and check_surrogates and _SURROGATE.search(v):
            raise _lone_surrogate(v)


def _lone_surrogate(s: str) -> ApiError:
    m = _SURROGATE.search(s)
    at = m.start() if m is not None else 0
    return _refuse(
        f"a string in the body holds a lone UTF-16 surrogate (\\u{ord(s[at]):04x} at character {at}): "
        "not Unicode text; send characters outside the BMP as a surrogate pair or as UTF-8",
        "invalid_unicode",
    )


async def read_json(request: Request, limit: int) -> object:
    """The body as JSON under the limits above; ApiError 400 otherwise."""
    raw = await read_body(request, limit)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _refuse(
            f"the request body is not UTF-8: byte 0x{raw[e.start]:02x} at offset {e.start} ({e.reason})",
            "invalid_encoding",
        ) from None
    text = text.removeprefix("\ufeff")  # a byte order mark before the JSON (as FastAPI's own parsing takes it)
    if not text.strip():
        raise _refuse("the request body is empty: send a JSON object with the request's fields", "invalid_json")
    # a cheap count first: a body with fewer brackets than the limit cannot nest deeper
    deep = text.count("[") + text.count("{") > MAX_DEPTH
    try:
        doc = json.loads(text)
    except RecursionError:
        raise _refuse(f"the JSON body is nested deeper than {MAX_DEPTH} levels, the limit", "json_too_deep") from None
    except json.JSONDecodeError as e:
        raise _refuse(
            f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}", "invalid_json"
        ) from None
    surrogates = _SURROGATE_ESCAPE.search(text) is not None
    if deep or surrogates:
        _depth_and_surrogates(doc, surrogates)
    return doc


def check_expansion(prompts: int, n: int, limit: int) -> None:
    """A request of `prompts` x `n` sequences that no idle router could take at once: a 400 (a 429
    would tell the client to retry what can never succeed). limit 0: none."""
    if limit and prompts * n > limit:
        raise _refuse(
            f"this request expands to {prompts * n} sequences ({prompts} prompt(s) x n={n}); the router takes at "
            f"most {limit} at once (--max-queued-requests plus the decode nodes' slots): send fewer prompts "
            "or a smaller n",
            "too_many_sequences",
        )

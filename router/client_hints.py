"""What a client asks of admission besides its request fields: its API key's id (turns within a
class), and over HTTP the headers `x-pdserve-admission-timeout` (seconds; 0: wait as long as it
takes) and `x-pdserve-priority` (interactive | batch); `x-api-key` stands for `Authorization:
Bearer` when that is absent; `x-request-id` names the request (its answer's id; its node request
ids and log lines start with it). The front ends set `HINTS` for the
request's task; `GenerateService.admit` reads it (docs/api.md, "Admission")."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass

from router.admission import CLASS_NAMES
from serving.security import AUTH_KEY, Credentials, authorization, bearer, key_id, match

TIMEOUT_HEADER = "x-pdserve-admission-timeout"
REQUEST_ID_HEADER = "x-request-id"  # the client's id for the request: the answer's id, the log lines'
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
PRIORITY_HEADER = "x-pdserve-priority"
API_KEY_HEADER = "x-api-key"


@dataclass(frozen=True)
class Hints:
    tenant: str = ""
    priority: int | None = None  # None: the request's field
    budget_s: float | None = None  # None: the request's field, else the router's default
    request_id: str | None = None  # the client's X-Request-Id (HTTP)


HINTS: ContextVar[Hints | None] = ContextVar("pdserve_admission_hints", default=None)


def tenant_of(authorization: str | None, creds: Credentials) -> str:
    """The id of the API key an `authorization` value carries ("" without keys)."""
    d = match(bearer(authorization), creds.api_keys) if creds.api_keys else None
    return key_id(d) if d is not None else ""


def from_metadata(md: Iterable[tuple[str, str | bytes]], creds: Credentials) -> Hints:
    auth = next((v for k, v in md if k == AUTH_KEY), None)
    return Hints(tenant=tenant_of(auth.decode("latin-1") if isinstance(auth, bytes) else auth, creds))


def from_headers(headers: Mapping[str, str], creds: Credentials) -> Hints:
    """Hints from HTTP headers (a case-insensitive mapping); ValueError names a bad header."""
    budget = None
    if (v := headers.get(TIMEOUT_HEADER)) is not None:
        try:
            budget = float(v)
        except ValueError:
            budget = -1.0
        if not (math.isfinite(budget) and budget >= 0):
            raise ValueError(f"header {TIMEOUT_HEADER} must be a number of seconds >= 0 (0: no limit), got {v!r}")
    priority = None
    if (v := headers.get(PRIORITY_HEADER)) is not None:
        if v.strip().lower() not in CLASS_NAMES:
            raise ValueError(f"header {PRIORITY_HEADER} must be one of {', '.join(CLASS_NAMES)}, got {v!r}")
        priority = CLASS_NAMES.index(v.strip().lower())
    rid = headers.get(REQUEST_ID_HEADER)
    if rid is not None and not _REQUEST_ID.fullmatch(rid):
        raise ValueError(f"header {REQUEST_ID_HEADER} must be 1-64 of A-Z a-z 0-9 . _ : - (got {rid[:80]!r})")
    auth = authorization(headers.get(AUTH_KEY), headers.get(API_KEY_HEADER))
    return Hints(tenant_of(auth, creds), priority, budget, rid)

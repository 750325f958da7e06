"""Constraint: what a request's output must match (JSON schema, any JSON object, regex, Lark
grammar, one of a list of strings) and from which token on. A frozen value, checked when built:
a bad schema, regex or grammar is a ValueError naming the problem (INVALID_ARGUMENT / HTTP 400).
It travels on the wire as pdserve.v1.Constraint and in dicts as {kind, value, start_after_token}."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Literal, cast

Kind = Literal["json_schema", "json_object", "regex", "grammar", "choice"]
KINDS: tuple[Kind, ...] = ("json_schema", "json_object", "regex", "grammar", "choice")
MAX_VALUE_CHARS = 200_000  # a schema / grammar / regex / the choices together, at most
# a Lark rule with a max_tokens= or stop= attribute (`think[max_tokens=64]: ...`): llguidance
# cannot roll such a matcher back, which verifying drafts needs
_NO_ROLLBACK = re.compile(r"^[ \t]*\??[A-Za-z_]\w*[ \t]*\[[^\]\n]*\b(?:max_tokens|stop)[ \t]*=", re.M)


@dataclass(frozen=True)
class Constraint:
    kind: Kind
    # json_schema: the schema as JSON text (a dict is serialized); regex, grammar: the text;
    # choice: the strings, a tuple; json_object: "" (unused)
    value: str | tuple[str, ...] = ""
    # the mask applies only once this token id is in the output (e.g. `</think>`); None: from the
    # first token
    start_after_token: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(KINDS)} (got {self.kind!r})")
        object.__setattr__(self, "value", _normalize(self.kind, self.value))
        t = self.start_after_token
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t < 0):
            raise ValueError(f"constraint start_after_token must be a non-negative token id (got {t!r})")
        from engine.structured.grammar import check

        check(self.kind, self.value)

    @cached_property
    def drafts_ok(self) -> bool:
        """Whether its matcher can be rolled back, as verifying draft tokens needs: not for a
        grammar with a `max_tokens=` or `stop=` rule (a thinking budget's); such a request is
        decoded without drafts (docs/speculative.md)."""
        return not (self.kind == "grammar" and isinstance(self.value, str) and _NO_ROLLBACK.search(self.value))

    @property
    def key(self) -> tuple[str, str | tuple[str, ...]]:
        """What a compiled grammar is cached by (the start token is the matcher's, not the grammar's)."""
        return (self.kind, self.value)

    def to_dict(self) -> dict[str, object]:
        v = list(self.value) if isinstance(self.value, tuple) else self.value
        return {"kind": self.kind, "value": v, "start_after_token": self.start_after_token}

    @classmethod
    def from_value(cls, c: Constraint | Mapping[str, object] | None) -> Constraint | None:
        """A Constraint, a {kind, value, start_after_token} mapping, or None."""
        if c is None or isinstance(c, Constraint):
            return c
        if not isinstance(c, Mapping):
            raise ValueError(f"constraint must be a Constraint or a mapping (got {type(c).__name__})")
        unknown = sorted(set(c) - {"kind", "value", "start_after_token"})
        if unknown:
            raise ValueError(f"unknown constraint field(s): {', '.join(unknown)}")
        if "kind" not in c:
            raise ValueError("constraint needs a kind")
        value = cast(str | tuple[str, ...], c.get("value", ""))  # checked by _normalize
        start = cast(int | None, c.get("start_after_token"))  # checked by __post_init__
        return cls(kind=cast(Kind, c["kind"]), value=value, start_after_token=start)


def _normalize(kind: Kind, value: object) -> str | tuple[str, ...]:
    if kind == "json_object":
        return ""
    if kind == "choice":
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise ValueError(f"a choice constraint needs a list of strings (got {type(value).__name__})")
        if not value or not all(isinstance(s, str) and s for s in value):
            raise ValueError("a choice constraint needs at least one choice, each a non-empty string")
        choices: tuple[str, ...] = tuple(value)
        _check_size(kind, sum(len(s) for s in choices))
        return choices
    if kind == "json_schema" and isinstance(value, Mapping):
        value = json.dumps(value, sort_keys=True)
    if not isinstance(value, str) or not value:
        raise ValueError(f"a {kind} constraint needs a non-empty string (got {value!r:.60})")
    _check_size(kind, len(value))
    return value


def _check_size(kind: str, size: int) -> None:
    if size > MAX_VALUE_CHARS:
        raise ValueError(f"the {kind} constraint has {size} characters; at most {MAX_VALUE_CHARS}")

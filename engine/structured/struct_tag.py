"""A structural tag (vLLM's and SGLang's `structural_tag`, xgrammar's format) -> one llguidance
Lark grammar, with a ValueError naming the field for a bad shape.

Two forms are read:
- the legacy one, `{"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}`: free
  text until a trigger appears; from there the output is one of the structures whose `begin`
  starts with that trigger, its JSON per `schema`, then its `end`; then free text again;
- xgrammar's `{"format": {...}}` objects, the common subset: `const_string`, `json_schema`
  (style json), `regex`, `grammar`, `any_text` (`excludes`), `sequence`, `or`, `optional`,
  `star`, `plus`, `repeat`, `tag` (string `begin`, `end` a string or strings), `triggered_tags`
  (`at_least_one`, `stop_after_first`, `excludes`) and `tags_with_separator`.
Free text is a lazy lexeme ended by the first trigger (llguidance's tool-calling pattern); the
text after the last tag may contain no trigger. JSON whitespace is bounded as everywhere else.
A string that holds the text of one of the checkpoint's added tokens (`<tool_call>`; llguidance
reads those as special tokens, never as text) matches that token or its spelling."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from engine.json_text import json_value
from engine.structured.grammar import bounded_json

# the formats taken, and the fields each may have besides `type` (any other is refused, not ignored)
FIELDS = {
    "const_string": ("value",),
    "json_schema": ("json_schema", "style", "any_order"),
    "regex": ("pattern",),
    "grammar": ("grammar",),
    "any_text": ("excludes",),
    "sequence": ("elements",),
    "or": ("elements",),
    "optional": ("content",),
    "star": ("content",),
    "plus": ("content",),
    "repeat": ("content", "min", "max"),
    "tag": ("begin", "content", "end"),
    "triggered_tags": ("triggers", "tags", "at_least_one", "stop_after_first", "excludes"),
    "tags_with_separator": ("tags", "separator", "at_least_one", "stop_after_first"),
}
FORMATS = tuple(FIELDS)
ANY = "/(?s:.*)/"
REPEATS = {"optional": "?", "star": "*", "plus": "+"}


def structural_tag_grammar(value: object, where: str, specials: Mapping[str, int] | None = None) -> str:
    """The Lark grammar of a structural tag given as its JSON text or as a dict; `where` (the
    client's field) starts every error message; `specials`: the added tokens' texts and ids."""
    tag = json_value(value, where)
    if not isinstance(tag, dict):
        raise ValueError(f"{where} must be a JSON object (got {type(tag).__name__})")
    kind = tag.get("type", "structural_tag")
    if kind != "structural_tag":
        raise ValueError(f"{where}.type must be 'structural_tag' (got {kind!r})")
    b = _Builder(specials or {})
    if "structures" in tag or "triggers" in tag:
        _only(tag, where, ("type", "structures", "triggers"))
        start = b.legacy(tag.get("structures"), tag.get("triggers"), where)
    elif "format" in tag:
        _only(tag, where, ("type", "format"))
        start = b.fmt(tag["format"], f"{where}.format", tail=True)
    else:
        raise ValueError(f"{where} needs 'structures' and 'triggers', or a 'format' object")
    return "%llguidance {}\nstart: " + start + "\n" + "\n".join(b.rules) + f"\nANY: {ANY}\n"


def _only(obj: dict[str, object], where: str, allowed: tuple[str, ...]) -> None:
    unknown = sorted(k for k in obj if k not in allowed)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)} (allowed: {', '.join(allowed)})")


def _string(v: object, where: str, empty: bool = True) -> str:
    if not isinstance(v, str) or (not empty and not v):
        raise ValueError(f"{where} must be a {'' if empty else 'non-empty '}string (got {v!r:.60})")
    return v


def _strings(v: object, where: str, empty: bool) -> list[str]:
    if not isinstance(v, list) or (not empty and not v):
        raise ValueError(f"{where} must be a {'' if empty else 'non-empty '}list of strings")
    return [_string(s, f"{where}[{i}]", empty=False) for i, s in enumerate(v)]


def _count(v: object, where: str, least: int) -> int:
    if isinstance(v, int) and not isinstance(v, bool) and v >= least:
        return v
    raise ValueError(f"{where} must be an integer of at least {least} (got {v!r:.40})")


def _flag(v: object, where: str) -> bool:
    if isinstance(v, bool):
        return v
    raise ValueError(f"{where} must be true or false (got {v!r:.60})")


def _lit(s: str) -> str:
    """A Lark string literal ("" is no literal at all)."""
    return json.dumps(s) if s else ""


def _alt(items: list[str]) -> str:
    return "(" + " | ".join(items) + ")" if len(items) > 1 else items[0]


class _Builder:
    def __init__(self, specials: Mapping[str, int]) -> None:
        self.rules: list[str] = []
        self.specials = specials

    def lit(self, s: str) -> str:
        """A Lark expression of the string `s`: an added token's text in it matches the token (by
        id) or its spelling."""
        names = sorted((n for n in self.specials if n and n in s), key=len, reverse=True)
        if not names:
            return _lit(s)
        parts, pos = [], 0
        for m in re.finditer("|".join(map(re.escape, names)), s):
            parts += [_lit(s[pos : m.start()]), f"(<[{self.specials[m.group()]}]> | {_lit(m.group())})"]
            pos = m.end()
        return " ".join(p for p in (*parts, _lit(s[pos:])) if p)

    def token_first(self, s: str) -> str | None:
        """`s` as the added token it starts with, then the rest (None: it starts with none)."""
        name = max((n for n in self.specials if n and s.startswith(n)), key=len, default=None)
        if name is None:
            return None
        return " ".join(p for p in (f"<[{self.specials[name]}]>", self.lit(s[len(name) :])) if p)

    def rule(self, body: str, name: str = "r", lazy: bool = False) -> str:
        n = f"{name}_{len(self.rules)}"
        self.rules.append(f"{n}{'[lazy]' if lazy else ''}: {body}")
        return n

    def free(self, excluded: list[str]) -> str:
        """A terminal of any text holding none of `excluded`."""
        if not excluded:
            return "ANY"
        term = f"FREE_{len(self.rules)}"
        self.rules.append(f"{term}: ANY & ~(ANY {_alt([_lit(s) for s in excluded])} ANY)")
        return term

    def legacy(self, structures: object, triggers: object, where: str) -> str:
        if not isinstance(structures, list) or not structures:
            raise ValueError(f"{where}.structures must be a non-empty list of {{begin, schema, end}}")
        trig = _strings(triggers, f"{where}.triggers", empty=False)
        tags = []
        for i, s in enumerate(structures):
            at = f"{where}.structures[{i}]"
            if not isinstance(s, dict):
                raise ValueError(f"{at} must be an object with begin, schema and end")
            _only(s, at, ("begin", "schema", "end"))
            for k in ("begin", "schema", "end"):
                if k not in s:
                    raise ValueError(f"{at} needs '{k}'")
            schema = s["schema"]
            if not isinstance(schema, dict):
                raise ValueError(f"{at}.schema must be a JSON schema object (got {type(schema).__name__})")
            content = {"type": "json_schema", "json_schema": schema}
            tags.append({"type": "tag", "begin": s["begin"], "content": content, "end": s["end"]})
        return self.triggered(trig, tags, False, False, [], where, tags_key="structures")

    def fmt(self, f: object, where: str, tail: bool) -> str:
        """A format object as a Lark expression; `tail`: nothing follows it in the output (an
        unbounded format, free text, may only be there)."""
        if not isinstance(f, dict) or f.get("type") not in FORMATS:
            kind = f.get("type") if isinstance(f, dict) else f
            raise ValueError(f"{where}.type {kind!r:.60} not supported (supported: {', '.join(FORMATS)})")
        kind = f["type"]
        _only(f, where, ("type", *FIELDS[kind]))
        if kind == "const_string":
            return self.lit(_string(f.get("value"), f"{where}.value", empty=False))
        if kind == "json_schema":
            return self.json_schema(f, where)
        if kind == "regex":
            return "/" + _string(f.get("pattern"), f"{where}.pattern", empty=False).replace("/", "\\/") + "/"
        if kind == "grammar":
            return _nested_grammar(_string(f.get("grammar"), f"{where}.grammar", empty=False), f"{where}.grammar")
        if kind == "any_text":
            if not tail:
                raise ValueError(f"{where}: any_text must end the output or be a tag's content")
            return self.free(_strings(f.get("excludes", []), f"{where}.excludes", empty=True))
        if kind in ("sequence", "or"):
            els = f.get("elements")
            if not isinstance(els, list) or not els:
                raise ValueError(f"{where}.elements must be a non-empty list of formats")
            last = len(els) - 1
            parts = [
                self.fmt(e, f"{where}.elements[{i}]", tail and (kind == "or" or i == last)) for i, e in enumerate(els)
            ]
            return "(" + (" " if kind == "sequence" else " | ").join(parts) + ")"
        if kind in ("optional", "star", "plus", "repeat"):
            return self.repeated(f, where)
        if kind == "tag":
            return self.tag(f, where, tail, skip=0)
        tags = f.get("tags")
        if kind == "triggered_tags":
            if not tail:
                raise ValueError(f"{where}: triggered_tags must end the output")
            trig = _strings(f.get("triggers"), f"{where}.triggers", empty=False)
            excl = _strings(f.get("excludes", []), f"{where}.excludes", empty=True)
            first = _flag(f.get("at_least_one", False), f"{where}.at_least_one")
            stop = _flag(f.get("stop_after_first", False), f"{where}.stop_after_first")
            return self.triggered(trig, tags, first, stop, excl, where)
        return self.separated(f, where, tail)

    def json_schema(self, f: dict[str, object], where: str) -> str:
        schema = f.get("json_schema")
        if not isinstance(schema, dict):
            raise ValueError(f"{where}.json_schema must be a JSON schema object (got {type(schema).__name__})")
        if f.get("style", "json") != "json":
            raise ValueError(f"{where}.style {f['style']!r:.40} not supported (only 'json')")
        if f.get("any_order", False) is not False:
            raise ValueError(f"{where}.any_order not supported (properties follow the schema's order)")
        return "%json " + json.dumps(bounded_json(schema))

    def repeated(self, f: dict[str, object], where: str) -> str:
        inner = self.fmt(f.get("content"), f"{where}.content", tail=False)
        kind = f["type"]
        if kind != "repeat":
            return f"({inner}){REPEATS[str(kind)]}"
        lo, hi = _count(f.get("min"), f"{where}.min", 0), _count(f.get("max"), f"{where}.max", -1)
        if hi != -1 and hi < lo:
            raise ValueError(f"{where}.max ({hi}) is below min ({lo})")
        return f"({inner}){{{lo},{'' if hi == -1 else hi}}}"

    def tag(self, t: object, where: str, tail: bool, skip: int) -> str:
        """begin (less its first `skip` characters: the trigger already matched), content, end."""
        if not isinstance(t, dict) or t.get("type", "tag") != "tag":
            raise ValueError(f"{where} must be a tag object ({{type: tag, begin, content, end}})")
        _only(t, where, ("type", *FIELDS["tag"]))
        for k in ("begin", "content", "end"):
            if k not in t:
                raise ValueError(f"{where} needs '{k}'")
        begin = _string(t["begin"], f"{where}.begin")
        end = t["end"]
        ends = _strings(end, f"{where}.end", empty=False) if isinstance(end, list) else [_string(end, f"{where}.end")]
        content = t["content"]
        if isinstance(content, dict) and content.get("type") == "any_text" and any(ends):
            # free text up to the first end string: one lazy lexeme that takes the end with it, or
            # text holding no end, then an end that is an added token
            _only(content, f"{where}.content", ("type", *FIELDS["any_text"]))
            excl = _strings(content.get("excludes", []), f"{where}.content.excludes", empty=True)
            bodies = [self.rule(f"{self.free(excl)} {_alt([_lit(e) for e in ends])}", "text", lazy=True)]
            tokens = [t for t in map(self.token_first, ends) if t is not None]
            if tokens:
                bodies.append(f"{self.free([*excl, *ends])} {_alt(tokens)}")
            return f"{self.lit(begin[skip:])} {_alt(bodies)}".strip()
        inner = self.fmt(content, f"{where}.content", tail=tail and not any(ends))
        close = _alt([self.lit(e) for e in ends]) if any(ends) else ""
        return " ".join(p for p in (self.lit(begin[skip:]), inner, close) if p)

    def triggered(
        self,
        triggers: list[str],
        tags: object,
        at_least_one: bool,
        stop_after_first: bool,
        excludes: list[str],
        where: str,
        tags_key: str = "tags",
    ) -> str:
        if not isinstance(tags, list) or not tags:
            raise ValueError(f"{where}.{tags_key} must be a non-empty list")
        for i, t in enumerate(tags):
            b = t.get("begin") if isinstance(t, dict) else None
            at = f"{where}.{tags_key}[{i}].begin"
            if not any(_string(b, at, empty=False).startswith(tr) for tr in triggers):
                raise ValueError(f"{at} {b!r:.60} starts with none of the triggers {triggers!r:.120}")
        mine = [[i for i, t in enumerate(tags) if t["begin"].startswith(tr)] for tr in triggers]
        for j, tr in enumerate(triggers):
            if not mine[j]:
                raise ValueError(f"{where}.triggers[{j}] {tr!r:.60} begins none of the {tags_key}")
        whole = (
            _alt([self.tag(t, f"{where}.{tags_key}[{i}]", False, 0) for i, t in enumerate(tags)])
            if at_least_one
            else ""
        )
        if at_least_one and stop_after_first:
            return whole
        segments = []
        for j, tr in enumerate(triggers):
            bodies = [self.tag(tags[i], f"{where}.{tags_key}[{i}]", False, len(tr)) for i in mine[j]]
            head = self.rule(f"{self.free(excludes)} {_lit(tr)}", "head", lazy=True)
            token = self.token_first(tr)  # a trigger an added token starts: that token ends the text too
            if token is not None:
                head = f"({head} | {self.free([*triggers, *excludes])} {token})"
            segments.append(f"{head} {_alt(bodies)}")
        seg = self.rule(" | ".join(segments), "seg")
        rest = self.free([*triggers, *excludes])
        if at_least_one:
            return f"{whole} {seg}* {rest}"
        return f"({seg} | {rest})" if stop_after_first else f"{seg}* {rest}"

    def separated(self, f: dict[str, object], where: str, tail: bool) -> str:
        tags = f.get("tags")
        if not isinstance(tags, list) or not tags:
            raise ValueError(f"{where}.tags must be a non-empty list")
        sep = _string(f.get("separator"), f"{where}.separator")
        first = _flag(f.get("at_least_one", False), f"{where}.at_least_one")
        stop = _flag(f.get("stop_after_first", False), f"{where}.stop_after_first")
        one = self.rule(" | ".join(self.tag(t, f"{where}.tags[{i}]", False, 0) for i, t in enumerate(tags)), "tag")
        more = f"({self.lit(sep)} {one})*" if sep else f"{one}*"
        body = one if stop else f"{one} {more}"
        return body if first else f"({body})?"


def _nested_grammar(text: str, where: str) -> str:
    """A grammar (Lark, or GBNF/EBNF as xgrammar writes it) nested as `%lark {...}`."""
    from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax  # noqa: PLC0415 (only a grammar needs it)

    if not is_lark_syntax(text):
        try:
            text = gbnf_to_lark(text)
        except Exception as e:  # noqa: BLE001 (the converter raises its own error types)
            raise ValueError(f"{where} is neither a Lark grammar nor GBNF that converts to one: {e}") from None
    return "%lark {\n" + text + "\n}"

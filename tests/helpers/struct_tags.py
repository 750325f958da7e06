"""A direct scan of text under a legacy structural tag (vLLM's `structures` and `triggers`), the
reference the grammar's tests compare with: each free-text stretch ends where a trigger first
ends; what follows must be one of the structures whose `begin` starts with that trigger, JSON
that validates against its schema (jsonschema), then its `end`; then free text again."""

from __future__ import annotations

import json

import jsonschema


def scan(tag: dict, text: str, cut: bool = False) -> int | None:
    """How many tags `text` holds, all valid; None when one is not. `cut`: the text was cut by
    max_tokens, so the last tag may be unfinished (its begin, or a prefix of it, is checked)."""
    pos, count = 0, 0
    while True:
        ends = [(text.find(t, pos) + len(t), t) for t in tag["triggers"] if text.find(t, pos) >= 0]
        if not ends:
            return count
        end, trig = min(ends)
        at = end - len(trig)
        begins = [s for s in tag["structures"] if s["begin"].startswith(trig)]
        for s in begins:
            if not text.startswith(s["begin"], at):
                continue
            try:
                value, k = json.JSONDecoder().raw_decode(text, at + len(s["begin"]))
                jsonschema.validate(value, s["schema"])
            except (ValueError, jsonschema.ValidationError):
                continue
            if text.startswith(s["end"], k):
                pos, count = k + len(s["end"]), count + 1
                break
        else:
            tail = text[at:]
            unfinished = any(tail.startswith(s["begin"]) or s["begin"].startswith(tail) for s in begins)
            return count if cut and unfinished else None

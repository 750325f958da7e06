"""Constraints with an independent check of the output (jsonschema, Python's re), shared by the
engine and serving tests."""

from __future__ import annotations

import json
import re

from engine.sampling_params import SamplingParams
from engine.step import RowInput
from engine.structured.grammar import bounded_json

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "n", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-[0-9]{3}"
CHOICES = ["red", "green", "blue", "rose"]

INNER = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["a"],
    "additionalProperties": False,
}
# a Lark grammar embedding a JSON schema (its whitespace bounded as json_schema's)
GRAMMAR = 'start: "result=" obj " #" tag\nobj: %json ' + json.dumps(bounded_json(INNER)) + "\ntag: /[a-z]{2,4}/"

CONSTRAINTS = {
    "json_schema": {"kind": "json_schema", "value": SCHEMA},
    "regex": {"kind": "regex", "value": REGEX},
    "choice": {"kind": "choice", "value": CHOICES},
    "json_object": {"kind": "json_object"},
    "grammar": {"kind": "grammar", "value": GRAMMAR},
}


def check(kind: str, text: str) -> None:
    """AssertionError unless `text` satisfies the constraint of that kind."""
    if kind == "json_schema":
        import jsonschema  # here: the GPU host's image may lack it (tests/structured/test_cuda.py)

        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    elif kind == "grammar":
        m = re.fullmatch(r"result=(.*) #([a-z]{2,4})", text, re.S)
        assert m, text
        obj = json.loads(m.group(1))
        assert isinstance(obj, dict) and set(obj) == {"a"} and 0 <= obj["a"] <= 999, text
        assert not re.search(r"\s{18}", m.group(1)), text  # whitespace bounded
    else:
        raise ValueError(kind)


def object_bias(tok) -> dict[int, float]:
    """json_object on a random-weight model: its strings and objects would rarely close, so the
    quote and the closing brace are favoured (the mask still decides where they may go)."""
    return {tok.encode('"')[0]: 10.0, tok.encode("}")[0]: 5.0}


EOS = 0  # the tiny tokenizer's <|endoftext|>


def sampling_row(params: SamplingParams, drafts: list[int], rid: str = "r") -> RowInput:
    """A decode row that samples after token 5 and verifies `drafts` (engine/step.py)."""
    return RowInput(
        request_id=rid,
        token_ids=[5, *drafts],
        start_pos=3,
        slot=0,
        block_ids=[0],
        is_decode=True,
        sample=True,
        params=params,
        num_draft=len(drafts),
        history=([1, 2, 3], [5]) if params.constraint is None else ([1, 2, 3], []),
    )

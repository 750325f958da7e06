"""Anthropic answers built from chat deltas (router/anthropic_output.py): a tool_use block's
`input` is its arguments' JSON object with every number as the model wrote it, so the whole
message is strict JSON (the reference: the standard library's parser with NaN / Infinity refused)
even where a number overflows a double."""

from __future__ import annotations

import json

from router.anthropic_output import Blocks, body, message


def _strict(text: str):
    def refuse(name: str):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_tool_input_numbers_stay_as_written():
    b = Blocks()
    args = '{"n": 1e999, "f": 0.10, "m": -1E+400, "s": "x"}'
    b.feed({"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": args[:9]}}]})
    b.feed({"tool_calls": [{"index": 0, "function": {"arguments": args[9:]}}]})
    b.close()
    text = body(message("msg_1", "m", b.blocks, "tool_use", "", {}))
    got = _strict(text)["content"][0]
    assert got["type"] == "tool_use" and got["id"] == "toolu_1" and got["input"]["s"] == "x"
    assert '"n": 1e999' in text and '"f": 0.10' in text and '"m": -1E+400' in text
    assert _strict(text)["content"][0]["input"]["f"] == 0.1


def test_cut_off_arguments_are_an_empty_input():
    b = Blocks()
    b.feed({"tool_calls": [{"index": 0, "id": "call_2", "function": {"name": "f", "arguments": '{"a": 1'}}]})
    b.close()
    assert _strict(body(message("msg_2", "m", b.blocks, "max_tokens", "", {})))["content"][0]["input"] == {}

"""The chat output parsers (router/parsers/): reasoning split, tool calls in Qwen's XML format and
the older JSON-in-<tool_call> format. Each output is tokenized by the tiny checkpoint's tokenizer
and fed through the router's incremental detokenizer split at every token boundary, and again
at every character boundary: the streamed deltas must reassemble to exactly the expected message,
written out by hand here (arguments: json.dumps of the values the text spells)."""

from __future__ import annotations

import json

import pytest

from engine.tiny_model import TinyModelSpec, make_tiny_model
from engine.tokenizer import Tokenizer
from router.detok import IncrementalDetokenizer
from router.parsers.output import ChatOutput

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "where": {"type": "object"},
                },
                "required": ["city"],
            },
        },
    }
]


def xml_call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def json_call(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def call(name: str, args: dict | str) -> dict:
    a = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {"type": "function", "function": {"name": name, "arguments": a}}


PARIS = xml_call("get_weather", city="Paris", days="3")
PARIS_ARGS = {"city": "Paris", "days": 3}
# (name, format, reasoning parser on, prompt opened <think>, output text, expected message)
CASES = [
    (
        "thinking then content",
        None,
        True,
        True,
        "I should greet.\n</think>\n\nHello there!",
        {"content": "Hello there!", "reasoning_content": "I should greet."},
    ),
    ("thinking off", None, True, False, "Hello there!", {"content": "Hello there!", "reasoning_content": None}),
    (
        "cut off in the reasoning",
        None,
        True,
        True,
        "Still thinking about <tool_resp",
        {"content": "", "reasoning_content": "Still thinking about <tool_resp"},
    ),
    (
        "model opens its own think",
        None,
        True,
        False,
        "<think>\nhmm\n</think>\n\nyes",
        {"content": "yes", "reasoning_content": "hmm"},
    ),
    ("no reasoning parser", None, False, True, "a</think>b", {"content": "a</think>b"}),
    (
        "one call after thinking",
        "xml",
        True,
        True,
        "Need weather.\n</think>\n\n" + PARIS,
        {"content": None, "reasoning_content": "Need weather.", "tool_calls": [call("get_weather", PARIS_ARGS)]},
    ),
    (
        "call inside the reasoning",
        "xml",
        True,
        True,
        "Let me call " + PARIS + " and see.\n</think>\n\nDone.",
        {
            "content": "Done.",
            "reasoning_content": "Let me call  and see.",
            "tool_calls": [call("get_weather", PARIS_ARGS)],
        },
    ),
    (
        "several calls, typed values",
        "xml",
        True,
        False,
        PARIS
        + "\n"
        + xml_call("get_weather", city="New\nYork <NY>", metric="True", where='{"lat": 40.7}', extra="x")
        + "\n"
        + xml_call("nothing"),
        {
            "content": None,
            "reasoning_content": None,
            "tool_calls": [
                call("get_weather", PARIS_ARGS),
                call("get_weather", {"city": "New\nYork <NY>", "metric": True, "where": {"lat": 40.7}, "extra": "x"}),
                call("nothing", {}),
            ],
        },
    ),
    (
        "text before a call",
        "xml",
        False,
        False,
        "Sure. " + PARIS,
        {"content": "Sure.", "tool_calls": [call("get_weather", PARIS_ARGS)]},
    ),
    (
        "truncated in a value",
        "xml",
        False,
        False,
        PARIS + "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nLyo",
        {"content": None, "tool_calls": [call("get_weather", PARIS_ARGS), call("get_weather", '{"city": "Lyo')]},
    ),
    (
        "truncated before the name",
        "xml",
        False,
        False,
        "ok <tool_call>\n<functi",
        {"content": "ok <tool_call>\n<functi"},
    ),
    (
        "a second call truncated before its name",
        "xml",
        False,
        False,
        PARIS + "\n<tool_call>\n<funct",
        {"content": None, "tool_calls": [call("get_weather", PARIS_ARGS)]},
    ),
    (
        "not a call",
        "xml",
        False,
        False,
        "<tool_call>\nplain words\n</tool_call> after",
        {"content": "<tool_call>\nplain words\n</tool_call> after"},
    ),
    (
        "junk after a call's function",
        "xml",
        False,
        False,
        PARIS.replace("</function>\n", "</function>\nstray words\n"),
        {"content": "\nstray words", "tool_calls": [call("get_weather", PARIS_ARGS)]},
    ),
    (
        "json format",
        "json",
        True,
        True,
        "plan\n</think>\n\n"
        + json_call("get_weather", {"city": "Oslo"})
        + "\n"
        + json_call("get_weather", {"city": "Rome", "days": 2}),
        {
            "content": None,
            "reasoning_content": "plan",
            "tool_calls": [call("get_weather", {"city": "Oslo"}), call("get_weather", {"city": "Rome", "days": 2})],
        },
    ),
    (
        "json format truncated",
        "json",
        False,
        False,
        json_call("get_weather", {"city": "Oslo"})[:-20],
        {"content": None, "tool_calls": [call("get_weather", "")]},
    ),
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("parsers") / "ckpt", TinyModelSpec(layers=1, hidden=64))
    return Tokenizer(path)


def assemble(fmt, reasoning, think_open, pieces) -> dict:
    """The message the stream deltas of `pieces` add up to, as a client assembles it."""
    out = ChatOutput(fmt, TOOLS, reasoning, think_open)
    msg: dict = {"content": "", "calls": {}}
    for i, p in enumerate(pieces):
        d = out.push(p, final=i == len(pieces) - 1)
        msg["content"] += d.get("content", "")
        if "reasoning_content" in d:
            msg["reasoning_content"] = msg.get("reasoning_content", "") + d["reasoning_content"]
        for tc in d.get("tool_calls", ()):
            c = msg["calls"].setdefault(tc["index"], {"type": "function", "function": {"name": "", "arguments": ""}})
            c["function"]["name"] += tc["function"].get("name", "")
            c["function"]["arguments"] += tc["function"].get("arguments", "")
            assert ("id" in tc) == ("name" in tc["function"])  # the id comes with the name, once
    whole = out.message()
    for c in whole.get("tool_calls", ()):
        assert c.pop("id").startswith("call_")
    calls = [msg["calls"][i] for i in sorted(msg["calls"])]
    assert calls == whole.get("tool_calls", [])
    assert msg["content"] == (whole["content"] or "")
    assert msg.get("reasoning_content") == whole.get("reasoning_content")
    whole.pop("role")
    return whole


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_streamed_pieces_reassemble_to_the_message(tok, case):
    _, fmt, reasoning, think_open, text, want = case
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    want = {k: v for k, v in want.items() if reasoning or k != "reasoning_content"}
    if reasoning:
        want.setdefault("reasoning_content", None)
    assert assemble(fmt, reasoning, think_open, [text]) == want
    for cut in range(1, len(ids)):  # the detokenizer's deltas with the ids split at every token boundary
        d = IncrementalDetokenizer(tok)
        pieces = [d.push(ids[:cut]), d.push(ids[cut:], final=True)]
        assert assemble(fmt, reasoning, think_open, pieces) == want, cut
    d = IncrementalDetokenizer(tok)  # one delta per token
    pieces = [d.push([t], final=k == len(ids) - 1) for k, t in enumerate(ids)]
    assert assemble(fmt, reasoning, think_open, pieces) == want
    for cut in range(1, len(text)):  # and at every character
        assert assemble(fmt, reasoning, think_open, [text[:cut], text[cut:]]) == want, cut


def test_vllm_parser_names_are_taken():
    """vLLM's command-line names for the parsers (users copy its Qwen3.5 recipes) map onto the
    router's; `--enable-auto-tool-choice` is accepted; an unknown name is still refused."""
    from router.config import RouterConfig

    for name, want in (("qwen3_coder", "xml"), ("qwen3_xml", "xml"), ("hermes", "json"), ("xml", "xml")):
        assert RouterConfig(tool_call_parser=name).tool_call_parser == want  # type: ignore[arg-type]
    for name, want in (("qwen3", "think"), ("deepseek_r1", "think"), ("none", "none")):
        assert RouterConfig(reasoning_parser=name).reasoning_parser == want  # type: ignore[arg-type]
    from router.cli import build_parser

    p = build_parser()
    a = p.parse_args(["router", "--tool-call-parser", "qwen3_coder", "--enable-auto-tool-choice"])
    assert a.tool_call_parser == "qwen3_coder" and a.enable_auto_tool_choice is True
    with pytest.raises(SystemExit):
        p.parse_args(["router", "--tool-call-parser", "mistral"])


def _strict(text: str):
    """RFC 8259 JSON: Python's json.loads, its NaN / Infinity extension refused."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in {text!r}"))


@pytest.mark.parametrize("fmt", ["xml", "json"])
def test_call_arguments_stay_json_with_huge_numbers(fmt):
    """A number too large for a float (the grammar allows any exponent) is JSON as written, not
    Python's `Infinity`, which strict parsers (JavaScript's JSON.parse) refuse; NaN or Infinity
    the model writes itself are no JSON numbers: a string (XML) or text (JSON) as any unparsable
    value."""
    if fmt == "xml":
        text = xml_call("get_weather", city="Oslo", days="1e999", where='{"lat": 1e+3997, "lon": -2.50}')
    else:
        text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1e999, "lat": -2.50}}\n</tool_call>'
    msg = ChatOutput(fmt, TOOLS, False, False)
    msg.push(text, final=True)
    args = msg.message()["tool_calls"][0]["function"]["arguments"]
    got = _strict(args)
    assert got["city"] == "Oslo" and got["days"] == float("inf")  # as JSON reads 1e999: a number
    assert "1e999" in args and "-2.50" in args
    if fmt == "xml":
        assert got["where"]["lat"] == float("inf") and "1e+3997" in args
        nan = ChatOutput(fmt, TOOLS, False, False)
        nan.push(xml_call("get_weather", city="Oslo", where="NaN"), final=True)
        assert _strict(nan.message()["tool_calls"][0]["function"]["arguments"])["where"] == "NaN"

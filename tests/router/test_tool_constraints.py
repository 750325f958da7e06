"""OpenAI's custom tools (router/custom_tools.py) on the router tests' checkpoint's Qwen3.5-shaped template:
the prompt is transformers' rendering of the same tool as a function of one string `input` (and of
a custom call in the history as that function's call); a forced call's grammar accepts a call whose
input is in the tool's own grammar and refuses one that is not (llguidance on the checkpoint's
tokenizer, the language checked independently with Python's `re`); the parser gives the input back
as `{"type": "custom", "custom": {"name", "input"}}`, streamed pieces folding to the whole; bad
formats are a 400 naming the field; under `auto`, a strict function tool or a custom tool's
grammar constrains the calls after free text; `allowed_tools` limits the calls to the tools it
lists."""

from __future__ import annotations

import json
import re

import pytest

from engine.tokenizer import Tokenizer
from router.openai_chat import ChatFront
from router.openai_models import ApiError, ChatRequest
from router.parsers.output import ChatOutput

PATCH_RE = r"(add|del) [a-z]{1,8}\.py"
LARK = 'start: op " " name ".py"\nop: "add" | "del"\nname: /[a-z]{1,8}/'
USER = [{"role": "user", "content": "patch it"}]


def custom(syntax: str | None, name: str = "apply_patch") -> dict:
    fmt: dict = {"type": "text"}
    if syntax is not None:
        fmt = {"type": "grammar", "grammar": {"syntax": syntax, "definition": PATCH_RE if syntax == "regex" else LARK}}
    return {"type": "custom", "custom": {"name": name, "description": "Edit files", "format": fmt}}


def as_function(tool: dict) -> dict:
    """What the template must see, written out independently of the code under test."""
    fmt = tool["custom"]["format"]
    note = ""
    if fmt["type"] == "grammar":
        g = fmt["grammar"]
        note = f"\n\nThe input is text of this {g['syntax']} grammar:\n{g['definition']}"
    params = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
    fn = {"name": tool["custom"]["name"], "description": tool["custom"]["description"] + note, "parameters": params}
    return {"type": "function", "function": fn}


def req(**kw) -> ChatRequest:
    return ChatRequest.model_validate({"model": "m", "messages": USER, **kw})


@pytest.mark.parametrize("syntax", [None, "regex", "lark"])
def test_prompt_is_the_function_rendering(front, hf, syntax):
    tool = custom(syntax)
    history = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "custom", "custom": {"name": "apply_patch", "input": "add a.py"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    want_history = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "apply_patch", "arguments": {"input": "add a.py"}},
                }
            ],
        },
        history[2],
    ]
    got = front.prepare(ChatRequest.model_validate({"model": "m", "messages": history, "tools": [tool]}))
    want = hf.apply_chat_template(want_history, tools=[as_function(tool)], add_generation_prompt=True, tokenize=False)
    assert got.prompt == want


def _call_text(hf, name: str, value: str) -> str:
    """A call as the template itself renders it (transformers), cut out of the conversation."""
    prefix = hf.apply_chat_template(USER, tokenize=False)
    call = {"id": "c", "type": "function", "function": {"name": name, "arguments": {"input": value}}}
    full = hf.apply_chat_template([*USER, {"role": "assistant", "content": None, "tool_calls": [call]}], tokenize=False)
    return full[len(prefix) :].removeprefix("<|im_start|>assistant\n").removesuffix("<|im_end|>\n")


@pytest.mark.parametrize("syntax", ["regex", "lark"])
def test_forced_call_follows_the_tools_grammar(front, hf, syntax):
    import llguidance
    import llguidance.hf

    choice = {"type": "custom", "custom": {"name": "apply_patch"}}
    other = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}
    p = front.prepare(req(tools=[other, custom(syntax)], tool_choice=choice))
    lt = llguidance.hf.from_tokenizer(hf)

    def accepts(s: str) -> bool:
        m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_lark(p.constraint.grammar), log_level=0)
        return m.consume_tokens(hf.encode(s, add_special_tokens=False)) and m.is_accepting()

    for value in ("add main.py", "del x.py", "add main.js", "mv a.py", "add toolongname.py"):
        assert accepts(_call_text(hf, "apply_patch", value)) == bool(re.fullmatch(PATCH_RE, value)), value
    assert not accepts(_call_text(hf, "noop", "add a.py"))  # the named tool only


@pytest.mark.parametrize("pieces", [1, 3, 7])
def test_parsed_call_is_the_input(front, hf, pieces):
    value = 'line one\n  "quoted" <b> \\ back'
    text = "</think>\n\nok" + _call_text(hf, "apply_patch", value)  # the prompt leaves a think block open
    other = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}
    p = front.prepare(req(tools=[custom(None), other]))
    out: ChatOutput = p.output()
    step = max(1, len(text) // pieces)
    deltas = [out.push(text[i : i + step]) for i in range(0, len(text), step)] + [out.push("", final=True)]
    msg = out.message()
    (call,) = msg["tool_calls"]
    assert call["type"] == "custom" and call["custom"] == {"name": "apply_patch", "input": value}
    assert msg["content"] == "ok"
    streamed = [tc for d in deltas for tc in d.get("tool_calls", ())]
    assert streamed[0]["type"] == "custom" and streamed[0]["custom"]["name"] == "apply_patch"
    assert "".join(tc["custom"].get("input", "") for tc in streamed) == value
    # a function call beside it stays a function call with JSON arguments
    out2: ChatOutput = p.output()
    out2.push("</think>" + _call_text(hf, "apply_patch", "x") + "\n" + _call_text(hf, "noop", "y"), final=True)
    kinds = [(c["type"], c.get("function", c.get("custom"))) for c in out2.message()["tool_calls"]]
    assert kinds[0] == ("custom", {"name": "apply_patch", "input": "x"})
    assert kinds[1][0] == "function" and json.loads(kinds[1][1]["arguments"]) == {"input": "y"}


@pytest.mark.parametrize(
    "tool, param",
    [
        ({"type": "custom", "custom": {}}, "tools[0]"),
        ({"type": "custom", "custom": {"name": "t", "format": {"type": "yaml"}}}, "tools[0].custom.format"),
        (
            {"type": "custom", "custom": {"name": "t", "format": {"type": "grammar", "grammar": {"syntax": "peg"}}}},
            "tools[0].custom.format",
        ),
        (
            {
                "type": "custom",
                "custom": {
                    "name": "t",
                    "format": {"type": "grammar", "grammar": {"syntax": "lark", "definition": "x"}},
                },
            },
            "tools[0].custom.format",
        ),
        (
            {
                "type": "custom",
                "custom": {
                    "name": "t",
                    "format": {"type": "grammar", "grammar": {"syntax": "regex", "definition": "("}},
                },
            },
            "tools[0].custom.format",
        ),
    ],
)
def test_bad_custom_tools_are_a_400_naming_the_field(front, tool, param):
    with pytest.raises(ApiError) as e:
        front.prepare(req(tools=[tool]))
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_choice_naming_a_missing_custom_tool(front):
    with pytest.raises(ApiError) as e:
        front.prepare(req(tools=[custom(None)], tool_choice={"type": "custom", "custom": {"name": "nope"}}))
    assert e.value.param == "tool_choice"


def test_json_call_format_takes_regex_grammars(ckpt, hf):
    """Qwen3-Next's JSON calls: a regex grammar becomes the input string's pattern (anchored); a
    Lark grammar cannot be nested in a JSON string and is a 400 saying so; the parser gives the
    input back."""
    import llguidance
    import llguidance.hf

    front = ChatFront(Tokenizer(ckpt), tool_format="json")
    choice = {"type": "custom", "custom": {"name": "apply_patch"}}
    with pytest.raises(ApiError) as e:
        front.prepare(req(tools=[custom("lark")], tool_choice=choice))
    assert "XML call format" in e.value.message
    p = front.prepare(req(tools=[custom("regex")], tool_choice=choice))
    lt = llguidance.hf.from_tokenizer(hf)

    def call(value: str) -> str:
        return "<tool_call>\n" + json.dumps({"name": "apply_patch", "arguments": {"input": value}}) + "\n</tool_call>"

    for value in ("add main.py", "xadd main.py", "add main.pyx", "del q.js"):
        m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_lark(p.constraint.grammar), log_level=0)
        ok = m.consume_tokens(hf.encode(call(value), add_special_tokens=False)) and m.is_accepting()
        assert ok == bool(re.fullmatch(PATCH_RE, value)), value
    out: ChatOutput = p.output()
    out.push("</think>" + call("add a.py"), final=True)
    assert out.message()["tool_calls"][0]["custom"] == {"name": "apply_patch", "input": "add a.py"}


TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]},
    },
}


def _fn_call_text(hf, args: dict) -> str:
    prefix = hf.apply_chat_template(USER, tokenize=False)
    call = {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": args}}
    full = hf.apply_chat_template([*USER, {"role": "assistant", "content": None, "tool_calls": [call]}], tokenize=False)
    return full[len(prefix) :].removeprefix("<|im_start|>assistant\n").removesuffix("<|im_end|>\n")


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_with_strict_tools_constrains_the_calls_only(front, hf, parallel):
    """`auto` with a strict function tool (or a custom tool with a grammar): free text, then calls
    that follow their schemas; without one, or with a response format, as before."""
    import llguidance
    import llguidance.hf

    strict = {"type": "function", "function": dict(TIME["function"], strict=True)}
    think_off = {"chat_template_kwargs": {"enable_thinking": False}}
    lt = llguidance.hf.from_tokenizer(hf)

    def accepts(grammar: str, s: str) -> bool:
        m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
        return m.consume_tokens(hf.encode(s, add_special_tokens=False)) and m.is_accepting()

    ok, bad = _fn_call_text(hf, {"utc": True}), _fn_call_text(hf, {"utc": "maybe"})
    for tools in ([strict], [TIME, custom("regex")]):
        g = front.prepare(req(tools=tools, parallel_tool_calls=parallel, **think_off)).constraint.grammar
        assert accepts(g, "Just text, no call.") and accepts(g, "Let me check.\n\n" + ok)
        assert not accepts(g, "Let me check.\n\n" + bad)
        assert not accepts(g, ok + "\nand text after it")
        assert accepts(g, ok + "\n" + ok) == parallel
        # the call tag spelled in ordinary tokens (which the parser would read as a call) is refused
        spelled = [
            t for piece in ("Sure ", "<", "tool", "_call", ">") for t in hf.encode(piece, add_special_tokens=False)
        ]
        m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_lark(g), log_level=0)
        assert hf.convert_tokens_to_ids("<tool_call>") not in spelled and not m.consume_tokens(spelled)
    assert front.prepare(req(tools=[TIME], **think_off)).constraint is None
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    assert front.prepare(req(tools=[strict], response_format=fmt, **think_off)).constraint.json_schema
    assert front.prepare(req(tools=[strict], tool_choice="none", **think_off)).constraint is None


def test_allowed_tools_limit_the_calls(front, hf):
    """`allowed_tools`: every tool stays in the prompt; the calls may name the listed ones only
    (`required`: at least one of them; `auto`: text, then optionally calls of them)."""
    import llguidance
    import llguidance.hf

    other = {
        "type": "function",
        "function": {"name": "noop", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}},
    }
    tools = [TIME, other]
    think_off = {"chat_template_kwargs": {"enable_thinking": False}}
    lt = llguidance.hf.from_tokenizer(hf)

    def accepts(grammar: str, s: str) -> bool:
        m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
        return m.consume_tokens(hf.encode(s, add_special_tokens=False)) and m.is_accepting()

    time_call = _fn_call_text(hf, {"utc": True})
    noop_call = time_call.replace("get_time", "noop").replace("<parameter=utc>\ntrue", "<parameter=x>\n1")
    assert accepts(front.prepare(req(tools=tools, tool_choice="required", **think_off)).constraint.grammar, noop_call)
    only = {"type": "function", "function": {"name": "get_time"}}
    for mode in ("required", "auto"):
        choice = {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": [only]}}
        p = front.prepare(req(tools=tools, tool_choice=choice, **think_off))
        assert p.prompt == front.prepare(req(tools=tools, **think_off)).prompt  # every tool is in the prompt
        g = p.constraint.grammar
        assert accepts(g, time_call) and not accepts(g, noop_call)
        assert accepts(g, "Text only.") == (mode == "auto")
    for spec, param in (
        ({"mode": "sometimes", "tools": [only]}, "tool_choice.allowed_tools"),
        ({"mode": "auto", "tools": []}, "tool_choice.allowed_tools"),
        (
            {"mode": "auto", "tools": [{"type": "function", "function": {"name": "nope"}}]},
            "tool_choice.allowed_tools.tools[0]",
        ),
    ):
        with pytest.raises(ApiError) as e:
            front.prepare(req(tools=tools, tool_choice={"type": "allowed_tools", "allowed_tools": spec}))
        assert e.value.param == param, e.value.message


@pytest.mark.parametrize("extra_allowed", [None, True])
def test_json_calls_name_only_the_schemas_parameters(hf, extra_allowed):
    """In the JSON call format the arguments object holds the schema's parameters only (as the XML
    format's grammar does), unless the schema itself allows more."""
    import llguidance
    import llguidance.hf

    from router.tool_choice import call_grammar

    params = dict(TIME["function"]["parameters"])
    if extra_allowed is not None:
        params["additionalProperties"] = extra_allowed
    g = call_grammar("json", [{"name": "get_time", "parameters": params}], many=False)
    lt = llguidance.hf.from_tokenizer(hf)

    def accepts(args: dict) -> bool:
        s = "<tool_call>\n" + json.dumps({"name": "get_time", "arguments": args}) + "\n</tool_call>"
        m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_lark(g), log_level=0)
        return m.consume_tokens(hf.encode(s, add_special_tokens=False)) and m.is_accepting()

    assert accepts({"utc": True})
    assert accepts({"utc": True, "zone": "x"}) == bool(extra_allowed)


@pytest.mark.parametrize(
    "fmt",
    [{"type": "grammar", "syntax": "lark", "definition": "x"}, {"type": "grammar", "syntax": "peg"}, {"type": "yaml"}],
)
def test_responses_custom_tool_errors_name_its_flat_fields(fmt):
    """On /v1/responses a custom tool is flat: a bad format is named as the client wrote it."""
    from router.responses_request import ResponsesRequest, to_chat

    body = {"model": "m", "input": "x", "tools": [{"type": "custom", "name": "t", "format": fmt}]}
    with pytest.raises(ApiError) as e:
        to_chat(ResponsesRequest.model_validate(body))
    assert e.value.param == "tools[0].format" and ".custom." not in e.value.message, e.value.message


def test_a_string_parameters_max_length_counts_characters(front, hf):
    """A string value's maxLength bounds its characters: "a<b<c<d" (7) is past a bound of 5, which
    it passed when "<x" counted as one; with a bound the value holds no "<" (documented); without
    one, "<" is allowed (no "</")."""
    import llguidance
    import llguidance.hf

    def tool(**bounds):
        city = {"type": "string", **bounds}
        params = {"type": "object", "properties": {"city": city}, "required": ["city"]}
        return {"type": "function", "function": {"name": "get_time", "parameters": params}}

    lt = llguidance.hf.from_tokenizer(hf)

    def accepts(t: dict, city: str) -> bool:
        r = req(tools=[t], tool_choice="required", chat_template_kwargs={"enable_thinking": False})
        g = front.prepare(r).constraint.grammar
        m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_lark(g), log_level=0)
        return m.consume_tokens(hf.encode(_fn_call_text(hf, {"city": city}), add_special_tokens=False))

    bounded, floor = tool(maxLength=5), tool(minLength=3)
    assert accepts(bounded, "Paris") and not accepts(bounded, "Parist")
    assert not accepts(bounded, "a<b<c<d") and not accepts(bounded, "a<b")
    assert accepts(floor, "a<b<c<d") and not accepts(floor, "ab") and not accepts(floor, "a</b")

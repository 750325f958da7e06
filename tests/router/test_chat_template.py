"""The router's rendering of chat requests (router/chat_template.py) against transformers'
`apply_chat_template` on the tiny checkpoint (its Qwen3.5-shaped template, engine/tiny_template.py):
tools, assistant tool calls (arguments sent as a JSON string), tool results, enable_thinking,
continue_final_message; media parts refused naming the part; the tool-call grammars accept the
calls the template itself renders and refuse ones missing a required argument (llguidance)."""

from __future__ import annotations

import json

import pytest

from engine.tiny_model import TinyModelSpec, make_tiny_model
from engine.tokenizer import Tokenizer
from router.chat_template import ChatTemplate
from router.openai_models import ApiError, ChatRequest
from router.tool_choice import call_grammar, plan

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
ARGS = {"city": "Paris", "days": 3}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tmpl") / "ckpt", TinyModelSpec(layers=1, hidden=64)))


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def tmpl(ckpt):
    return ChatTemplate(Tokenizer(ckpt).chat_template)


def wire(messages):
    """The messages as an OpenAI client sends them: call arguments as a JSON string."""
    out = json.loads(json.dumps(messages))
    for m in out:
        for c in m.get("tool_calls") or ():
            c["function"]["arguments"] = json.dumps(c["function"]["arguments"])
    return out


def request(messages, **kw) -> ChatRequest:
    return ChatRequest.model_validate({"model": "m", "messages": wire(messages), **kw})


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"tools": TOOLS},
        {"tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}},
        {"add_generation_prompt": False},
    ],
    ids=["plain", "tools", "thinking-off", "no-generation-prompt"],
)
def test_render_equals_transformers(hf, tmpl, kw):
    r = tmpl.render(request(CONVERSATION, **kw))
    hf_kw = dict(kw.pop("chat_template_kwargs", {}), tools=kw.get("tools"))
    want = hf.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=kw.get("add_generation_prompt", True), **hf_kw
    )
    assert r.prompt == want
    assert r.think_open == want.endswith("<think>\n")


def test_enable_thinking_changes_the_prompt(tmpl):
    on = tmpl.render(request(CONVERSATION))
    off = tmpl.render(request(CONVERSATION, chat_template_kwargs={"enable_thinking": False}))
    assert on.prompt != off.prompt and on.think_open and not off.think_open
    assert off.prompt.endswith("<think>\n\n</think>\n\n")


def test_a_developer_message_is_the_system_message_unless_the_template_names_the_role(hf, tmpl):
    """OpenAI's `developer` role (what agent clients send for instructions) renders as transformers
    renders the same message as `system`; a template that has a `developer` role gets it as sent."""
    dev = [{"role": "developer", "content": "Be brief."}] + CONVERSATION[1:]
    assert tmpl.render(request(dev)).prompt == hf.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True
    )
    own = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'developer' %}D:{% else %}{{ m.role }}:{% endif %}{{ m.content }};{% endfor %}"
    )
    assert own.render(request([{"role": "developer", "content": "x"}])).prompt == "D:x;"


def test_continue_final_message_equals_transformers(hf, tmpl):
    msgs = [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "1, 2, "}]
    r = tmpl.render(request(msgs, add_generation_prompt=False, continue_final_message=True))
    assert r.prompt == hf.apply_chat_template(msgs, tokenize=False, continue_final_message=True)
    # unsent, add_generation_prompt follows continue_final_message (vLLM's); both sent true: refused
    assert tmpl.render(request(msgs, continue_final_message=True)).prompt == r.prompt
    with pytest.raises(ApiError) as e:
        tmpl.render(request(msgs, continue_final_message=True, add_generation_prompt=True))
    assert e.value.param == "continue_final_message"


def test_image_parts_render_the_placeholder_and_are_collected(hf, tmpl):
    parts = [{"type": "text", "text": "see "}, {"type": "image_url", "image_url": {"url": "data:,a"}}]
    parts.append({"type": "input_image", "image_url": "https://x/b.png"})
    msgs = [{"role": "system", "content": "x"}, {"role": "user", "content": parts}]
    r = tmpl.render(request(msgs))
    hf_msgs = [msgs[0], {"role": "user", "content": [parts[0], {"type": "image"}, {"type": "image"}]}]
    assert r.prompt == hf.apply_chat_template(hf_msgs, tokenize=False, add_generation_prompt=True)
    assert [(i.where, i.url) for i in r.images] == [
        ("messages[1].content[1]", "data:,a"),
        ("messages[1].content[2]", "https://x/b.png"),
    ]


def test_video_parts_are_refused(tmpl):
    from router.images.decode import ImageRefused

    msgs = [{"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "video_url", "video_url": {}}]}]
    with pytest.raises(ImageRefused) as e:
        tmpl.render(request(msgs))
    assert e.value.reason == "video" and str(e.value) == "messages[0].content[1]: video input is not supported yet"


@pytest.mark.parametrize("part", [{"type": "input_audio", "input_audio": {}}, {"type": "file", "file": {}}])
def test_other_media_parts_are_refused_by_name(tmpl, part):
    msgs = [{"role": "system", "content": "x"}, {"role": "user", "content": [{"type": "text", "text": "see"}, part]}]
    with pytest.raises(ApiError) as e:
        tmpl.render(request(msgs))
    assert e.value.status == 400 and e.value.param == "messages[1].content[1].type"
    assert part["type"] in e.value.message


def test_bad_call_arguments_name_the_field(tmpl):
    msgs = wire(CONVERSATION)
    msgs[2]["tool_calls"][0]["function"]["arguments"] = "{not json"
    with pytest.raises(ApiError) as e:
        tmpl.render(ChatRequest.model_validate({"model": "m", "messages": msgs}))
    assert e.value.param == "messages[2].tool_calls[0].function.arguments"


@pytest.mark.parametrize("fmt", ["xml", "json"])
def test_call_grammar_accepts_rendered_calls(ckpt, hf, fmt):
    import llguidance
    import llguidance.hf

    prefix = hf.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=False)
    full = hf.apply_chat_template(
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [CALL, CALL]}],
        tokenize=False,
    )
    xml = full[len(prefix) :].removeprefix("<|im_start|>assistant\n").removesuffix("<|im_end|>\n")
    as_json = "<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": ARGS}) + "\n</tool_call>"
    text = xml if fmt == "xml" else as_json + "\n" + as_json
    missing = (
        text.replace("city", "town") if fmt == "json" else text.replace("<parameter=city>\nParis\n</parameter>\n", "")
    )
    lt = llguidance.hf.from_tokenizer(hf)
    fns = [t["function"] for t in TOOLS]

    def accepts(grammar: str, s: str) -> bool:
        m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
        return m.consume_tokens(hf.encode(s, add_special_tokens=False)) and m.is_accepting()

    assert accepts(call_grammar(fmt, fns, many=True), text)
    assert not accepts(call_grammar(fmt, fns, many=False), text)  # two calls where one is allowed
    assert not accepts(call_grammar(fmt, fns, many=True), missing)
    if fmt == "json":  # whitespace inside the JSON is bounded, as in the JSON constraints
        assert not accepts(call_grammar(fmt, fns, many=True), text.replace(": ", ":" + " " * 6))


def test_tool_choice_plans():
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
    assert plan(ChatRequest.model_validate(base), "xml", None).constraint is None
    named = dict(base, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    p = plan(ChatRequest.model_validate(named), "xml", 7)
    assert p.parse and p.constraint.grammar and p.constraint.start_after_token == 7
    assert not plan(ChatRequest.model_validate(dict(base, tool_choice="none")), "xml", None).parse
    for bad, param in (
        (dict(base, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(base, tools=None, tool_choice="required"), "tool_choice"),
        (dict(base, tools=[{"type": "function", "function": {}}]), "tools[0]"),
        (dict(base, response_format={"type": "yaml"}), "response_format"),
    ):
        with pytest.raises(ApiError) as e:
            plan(ChatRequest.model_validate(bad), "xml", None)
        assert e.value.param == param
    js = dict(base, tools=None, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {}}})
    assert plan(ChatRequest.model_validate(js), "xml", 7).constraint.json_schema == "{}"


def test_parsers_are_chosen_from_the_template(ckpt):
    from router.openai_chat import ChatFront

    class Tok:
        def __init__(self, chat_template):
            self.chat_template = chat_template

        def token_to_id(self, t):
            return 7

    qwen35 = ChatFront(Tokenizer(ckpt))
    assert (qwen35.fmt, qwen35.reasoning) == ("xml", True)
    json_calls = "{{ '<tool_call>' }}{{ '<think>' }}{{ '</think>' }}"
    assert (ChatFront(Tok(json_calls)).fmt, ChatFront(Tok(json_calls)).reasoning) == ("json", True)
    plain = ChatFront(Tok("{{ messages[0].content }}"))
    assert (plain.fmt, plain.reasoning) == (None, False)
    forced = ChatFront(Tok("{{ messages[0].content }}"), reasoning="think", tool_format="json")
    assert (forced.fmt, forced.reasoning) == ("json", True)
    off = ChatFront(Tokenizer(ckpt), reasoning="none", tool_format="none")
    assert (off.fmt, off.reasoning) == (None, False)


def test_a_long_conversation_renders_off_the_loop(ckpt, hf, monkeypatch):
    """OpenAIFront.job renders chat messages past RENDER_INLINE_CHARS in a worker thread; the
    prompt is the same as transformers' rendering."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from router.config import RouterConfig
    from router.openai_api import RENDER_INLINE_CHARS, OpenAIFront
    from router.openai_chat import ChatFront

    service = SimpleNamespace(
        cfg=RouterConfig(),
        tokenizer=Tokenizer(ckpt),
        models=lambda: [SimpleNamespace(id="m", path=ckpt)],
        check_prompt_chars=lambda chars, what: None,
        expansion_limit=lambda: 64,
        gauge_sources=[],
    )
    front = OpenAIFront(service)
    threads = []
    prepare = ChatFront.prepare

    def spy(self, req):
        threads.append(threading.current_thread())
        return prepare(self, req)

    monkeypatch.setattr(ChatFront, "prepare", spy)
    msgs = [{"role": "user", "content": "word " * (RENDER_INLINE_CHARS // 5 + 1)}]
    for m in (msgs, [{"role": "user", "content": "short"}]):
        job = asyncio.run(front.job(request(m)))
        assert job.reqs[0].prompt == hf.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
    assert threads[0] is not threading.main_thread() and threads[1] is threading.main_thread()

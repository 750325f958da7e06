"""`POST /v1/responses` request bodies: the body (`ResponsesRequest`) turned into the
chat request it means (`to_chat`), which the chat path then serves (template, parsers,
constraints). Input items: messages (roles user / system / developer / assistant; content a
string or `input_text` / `output_text` parts, and `input_image` parts in user, system and
developer messages, named `input[i].content[j]` in errors), `function_call` and
`custom_tool_call` (an assistant turn's calls), `function_call_output` and
`custom_tool_call_output` (a tool message), `reasoning` (the next assistant turn's
reasoning_content: its content or summary text, else what router/responses_output.py carried in
its `encrypted_content`). `instructions` is the system message; `tools` are flat function and custom
tools (router/custom_tools.py);
`text.format` is the response format. `previous_response_id`'s conversation (router/responses_store.py)
comes before `input`; `conversation` is a 400 naming it. `truncation: "auto"` drops whole turns from
the conversation's start until the prompt fits (router/openai_responses.py `_fitted`; `turn_starts`
says where a turn may begin)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field

from router import custom_tools
from router.openai_models import ChatRequest, Float, NullIsUnset, bad, parse
from router.responses_output import carried

_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
_TEXT_ONLY = "text only: input_text, output_text"  # what an error says a message's parts may be
_WITH_IMAGES = "input_text, output_text and input_image only"


class ResponsesRequest(NullIsUnset):
    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields: logged once, no effect
    ROUTE: ClassVar[str] = "/v1/responses"

    model: Annotated[str, Field(min_length=1)] | None = None  # unset: the one model served
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[Float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Float, Field(ge=0.0, le=1.0)] | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None  # `effort`: chat's reasoning_effort; `summary` accepted, not used
    previous_response_id: Any = None  # a stored response this one continues (router/responses_store.py)
    store: bool | None = None  # keep it for previous_response_id / GET (unset: kept, OpenAI's default)
    conversation: Any = None
    truncation: Literal["auto", "disabled"] | None = None  # auto: the oldest turns go when it does not fit
    metadata: dict[str, Any] | None = None
    include: list[str] | None = None  # "reasoning.encrypted_content": reasoning carried opaquely (responses_output)
    # extensions, as on chat completions
    chat_template_kwargs: dict[str, Any] | None = None
    seed: int | None = None  # checked as chat's
    top_k: int | None = None
    ignore_eos: bool = False
    logit_bias: Any = None
    cache_salt: Any = None  # checked as chat's
    thinking_token_budget: Any = None  # checked as chat's

    @property
    def carries_reasoning(self) -> bool:
        return "reasoning.encrypted_content" in (self.include or ())


def _text_of(content: Any, where: str, allowed: str = _TEXT_ONLY) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or a list of parts", f"{where}.content")
    return "".join(_part_text(p, f"{where}.content[{j}]", allowed) for j, p in enumerate(content))


def _part_text(p: Any, at: str, allowed: str) -> str:
    """One text part's text; a 400 naming the part `at` for any other part (`allowed`: what the
    message takes, for the error)."""
    kind = p.get("type") if isinstance(p, dict) else None
    if kind not in _TEXT_PARTS:
        raise bad(f"{at}: '{kind}' parts are not supported ({allowed})", f"{at}.type")
    if not isinstance(p.get("text"), str):
        raise bad(f"{at}.text must be a string", f"{at}.text")
    return str(p["text"])


def _parts_of(content: Any, where: str, msg: int, names: dict[tuple[int, int], str]) -> str | list[dict[str, Any]]:
    """A user / system message's content: its text, or with `input_image` parts the chat parts
    (each part's name recorded under (msg, j) in `names`)."""
    if not isinstance(content, list) or not any(
        isinstance(p, dict) and p.get("type") == "input_image" for p in content
    ):
        return _text_of(content, where, _WITH_IMAGES)
    parts: list[dict[str, Any]] = []
    for j, p in enumerate(content):
        at = names[(msg, j)] = f"{where}.content[{j}]"
        if p.get("type") == "input_image":
            if p.get("detail") not in (None, "auto", "low", "high"):  # OpenAI's values (all served alike)
                raise bad(f"{at}.detail must be 'auto', 'low' or 'high'", f"{at}.detail")
            parts.append({"type": "input_image", "image_url": p.get("image_url")})
        else:
            parts.append({"type": "text", "text": _part_text(p, at, _WITH_IMAGES)})
    return parts


def _items(req: ResponsesRequest, prior: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation's input items: the stored ones, then the request's."""
    return prior + ([{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input)


def turn_starts(req: ResponsesRequest, prior: list[dict[str, Any]]) -> list[int]:
    """Where the conversation may be cut for `truncation: "auto"`: at a user message after the
    first item (the last one's turn is never dropped)."""
    items = _items(req, prior)
    return [
        i for i, it in enumerate(items) if i and it.get("type", "message") == "message" and it.get("role") == "user"
    ]


def _messages(
    req: ResponsesRequest, names: dict[tuple[int, int], str], prior: list[dict[str, Any]], skip: int = 0
) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    if req.instructions:
        msgs.append({"role": "system", "content": req.instructions})
    items = _items(req, prior)
    thought: str | None = None  # a reasoning item waits for the assistant turn it belongs to

    def assistant() -> dict[str, Any]:
        nonlocal thought
        last = msgs[-1] if msgs else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": None}
            msgs.append(last)
        if thought is not None:
            last["reasoning_content"], thought = thought, None
        return last

    def settle() -> None:
        """A reasoning item no assistant item followed (an output that ended while reasoning) is
        an assistant turn of its own, with no content."""
        if thought is not None:
            a = assistant()
            a["content"] = a["content"] or ""

    calls: set[Any] = set()  # the call ids so far, truncated turns' included
    for i, it in enumerate(items):
        kind = it.get("type", "message")
        if kind in ("function_call", "custom_tool_call") and isinstance(it.get("call_id"), str):
            calls.add(it["call_id"])  # (another value is refused below, naming the item)
        if i < skip:  # truncated
            continue
        where = f"input[{i - len(prior)}]" if i >= len(prior) else f"previous_response_id's input[{i}]"
        if kind in ("function_call_output", "custom_tool_call_output") or (
            kind == "message" and it.get("role") != "assistant"
        ):
            settle()
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad(f"{where}.role must be user, system, developer or assistant (got {role!r})", f"{where}.role")
            if role == "assistant":
                a = assistant()
                a["content"] = (a["content"] or "") + _text_of(it.get("content"), where)
            else:
                content = _parts_of(it.get("content"), where, len(msgs), names)
                msgs.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            if not isinstance(it.get("name"), str) or not isinstance(it.get("call_id"), str):
                raise bad(f"{where}: a function_call needs 'name' and 'call_id'", where)
            fn = {"name": it["name"], "arguments": it.get("arguments") or "{}"}
            assistant().setdefault("tool_calls", []).append({"id": it["call_id"], "type": "function", "function": fn})
        elif kind == "custom_tool_call":
            if not all(isinstance(it.get(k), str) for k in ("name", "call_id", "input")):
                raise bad(f"{where}: a custom_tool_call needs 'name', 'call_id' and 'input'", where)
            cu = {"name": it["name"], "input": it["input"]}
            assistant().setdefault("tool_calls", []).append({"id": it["call_id"], "type": "custom", "custom": cu})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            if not isinstance(it.get("call_id"), str) or it["call_id"] not in calls:  # as OpenAI's: after its call
                raise bad(f"{where}: no tool call before it has call_id {it.get('call_id')!r}", f"{where}.call_id")
            out = it.get("output")
            text = out if isinstance(out, str) else _text_of(out, where)
            msgs.append({"role": "tool", "tool_call_id": it.get("call_id"), "content": text})
        elif kind == "reasoning":
            parts = it.get("content") or it.get("summary") or []
            thought = _text_of(parts, where) or carried(it.get("encrypted_content")) or ""
        else:
            raise bad(f"{where}: items of type {kind!r} are not supported", f"{where}.type")
    settle()
    return msgs


def _tool_choice(choice: Any) -> Any:
    """Responses' flat tool_choice forms as chat's nested ones."""
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom") and "name" in choice:
        return {"type": choice["type"], choice["type"]: {"name": choice["name"]}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools" and isinstance(choice.get("tools"), list):
        listed = [_tool_choice(t) if isinstance(t, dict) else t for t in choice["tools"]]
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode"), "tools": listed}}
    return choice


def _tool(t: Any, i: int) -> dict[str, Any]:
    """A flat function or custom tool as chat's."""
    kind = t.get("type") if isinstance(t, dict) else None
    if kind not in ("function", "custom") or not isinstance(t.get("name"), str):
        raise bad(f"tools[{i}]: function or custom tools only ({{'type': 'function', 'name': ...}})", f"tools[{i}]")
    if kind == "function":
        return {
            "type": "function",
            "function": {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t},
        }
    c = {k: t[k] for k in ("name", "description") if k in t}
    fmt = t.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "grammar":  # flat here, nested on chat
        fmt = {"type": "grammar", "grammar": {k: fmt.get(k) for k in ("syntax", "definition")}}
    if fmt is not None:
        c["format"] = fmt
    tool = {"type": "custom", "custom": c}
    custom_tools.check_flat(tool, f"tools[{i}]")  # errors name the flat fields this body has
    return tool


def _response_format(text: dict[str, Any] | None) -> Any:
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return fmt
    js = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": js}


def to_chat(req: ResponsesRequest, prior: list[dict[str, Any]] | None = None, skip: int = 0) -> ChatRequest:
    """The chat request `req` means (module docstring), after the input items `prior` (the
    conversation of its previous_response_id), less the conversation's first `skip` items;
    ApiError 400 naming a bad field."""
    if req.conversation is not None:
        raise bad(
            "'conversation' is not supported: continue a stored response with previous_response_id, "
            "or send the whole input",
            "conversation",
        )
    tools = [_tool(t, i) for i, t in enumerate(req.tools)] if req.tools else None
    names: dict[tuple[int, int], str] = {}
    body: dict[str, Any] = {
        "model": req.model,
        "messages": _messages(req, names, prior or [], skip),
        "tools": tools,
        "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "max_tokens": req.max_output_tokens,
        "response_format": _response_format(req.text),
        "chat_template_kwargs": req.chat_template_kwargs,
        "ignore_eos": req.ignore_eos,
        "reasoning_effort": (req.reasoning or {}).get("effort"),
    }
    for name in ("temperature", "top_p", "seed", "top_k", "logit_bias", "cache_salt", "thinking_token_budget"):
        body[name] = getattr(req, name)
    chat = parse(ChatRequest, {k: v for k, v in body.items() if v is not None})
    assert isinstance(chat, ChatRequest)
    chat.part_names.update(names)
    chat.name_schemas("tools[{i}].parameters")
    chat.name_format("text.format")
    return chat

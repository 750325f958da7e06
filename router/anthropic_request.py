"""`POST /v1/messages` bodies (Anthropic's Messages API, as coding agents send it) as the chat
request they mean, served by the chat path (router/openai_chat.py) as one choice:

- `system` (a string or text blocks) -> a system message; each user message's `tool_result`
  blocks -> `tool` messages (in their order, before the message's text and images); `image`
  blocks (`base64` sources of Anthropic's four media types, checked against their bytes, or `url`
  sources) -> image parts; an assistant's `thinking` -> its
  `reasoning_content`, `tool_use` -> its `tool_calls` (`input`, an object, as the arguments' JSON);
- `tools` (`name`, `description`, `input_schema` (required), `strict`) -> function tools;
  `tool_choice` `auto`, `any` (-> `required`), `tool` (-> named), `none` (`any` and `tool` need
  `tools`); `disable_parallel_tool_use` -> `parallel_tool_calls`;
- `thinking` `enabled` / `adaptive` / `between_tools` / `disabled` -> the template's
  `enable_thinking` (unset: the template's default); `stop_sequences` -> `stop`;
  `output_config.format` (or the earlier `output_format`) `json_schema` -> `response_format`;
  `output_config.effort` -> `reasoning_effort`; `temperature`, `top_p`, `top_k` as earlier
  clients send them;
- `cache_control` marks are accepted and have no effect (the prefix cache needs none);
- a last message from the assistant with text (no `tool_use`) is continued, as Anthropic's API
  does (chat's `continue_final_message`): the answer starts right after its text.

Anything it cannot honour is a 400 naming it (server tools, documents, MCP servers)."""

from __future__ import annotations

import base64
import binascii
import json
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from router.openai_models import ChatRequest, Float, bad, parse
from router.stops import check_stops

# sampling fields passed on as the chat route takes them (earlier clients send the first three;
# the rest are the chat route's extensions)
_PASSED = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "logit_bias",
    "cache_salt",
)


class MessagesRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields: logged once, no effect
    ROUTE: ClassVar[str] = "/v1/messages"

    model: Annotated[str, Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # required by /v1/messages, not by count_tokens
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Annotated[Float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Float, Field(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # `format` (json_schema); `effort`: chat's reasoning_effort
    output_format: dict[str, Any] | None = None  # the earlier name of output_config.format
    metadata: dict[str, Any] | None = None  # accepted (`user_id`), not used
    service_tier: str | None = None  # accepted, not used: one tier
    mcp_servers: Any = None  # refused by name
    container: Any = None  # refused by name
    # extensions, as on chat completions
    seed: int | None = None  # checked as chat's
    min_p: Any = None
    repetition_penalty: Any = None
    ignore_eos: bool | None = None
    logit_bias: Any = None
    cache_salt: Any = None
    chat_template_kwargs: dict[str, Any] | None = None


def _text(content: Any, where: str) -> str:
    """A string, or text blocks joined (what a system prompt and a tool result may hold)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or a list of content blocks", where)
    out = []
    for j, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise bad(f"{where}[{j}]: only text blocks are supported here (got {kind!r})", f"{where}[{j}]")
        out.append(b["text"])
    return "".join(out)


_MEDIA = {"image/jpeg": (b"\xff\xd8\xff",), "image/png": (b"\x89PNG\r\n\x1a\n",), "image/gif": (b"GIF87a", b"GIF89a")}


def _kind(head: bytes) -> str | None:
    """The media type that an image's first bytes say (Anthropic's four), or None."""
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    return next((m for m, magic in _MEDIA.items() if head.startswith(magic)), None)


def _base64(src: dict[str, Any], where: str) -> str:
    """A base64 source as a data: URL, refused as Anthropic refuses it: a media type outside its
    four, data that is not base64, or data whose bytes are another format than the type it names."""
    media = src.get("media_type")
    if media not in (*_MEDIA, "image/webp"):
        raise bad(
            f"{where}.media_type must be one of image/jpeg, image/png, image/gif, image/webp", f"{where}.media_type"
        )
    try:
        head = base64.b64decode(src["data"], validate=True)[:16]
    except (binascii.Error, ValueError) as e:
        raise bad(f"{where}.data is not valid base64 ({e})", f"{where}.data") from None
    kind = _kind(head)
    if kind != media:
        what = f"{kind} data" if kind else "data that is none of those formats"
        raise bad(f"{where}: the image is {what}, but media_type says {media}", f"{where}.media_type")
    return f"data:{media};base64,{src['data']}"


def _image(b: dict[str, Any], where: str) -> dict[str, Any]:
    src: dict[str, Any] = b["source"] if isinstance(b.get("source"), dict) else {}
    if src.get("type") == "base64" and isinstance(src.get("data"), str):
        url = _base64(src, f"{where}.source")
    elif src.get("type") == "url" and isinstance(src.get("url"), str):
        url = src["url"]
    else:
        raise bad(f"{where}.source: an image needs a 'base64' source with 'data' or a 'url' source", f"{where}.source")
    return {"type": "image_url", "image_url": {"url": url}}


def _part(b: Any, where: str) -> dict[str, Any]:
    """A text or image block as a chat content part (the chat path joins text-only parts)."""
    kind = b.get("type") if isinstance(b, dict) else type(b).__name__
    if kind == "text" and isinstance(b.get("text"), str):
        return {"type": "text", "text": b["text"]}
    if kind == "image":
        return _image(b, where)
    raise bad(f"{where}: {kind!r} blocks are not supported here (text, image)", f"{where}.type")


def _result(content: Any, where: str, msg: int, names: dict[tuple[int, int], str]) -> str | list[dict[str, Any]]:
    """A tool result's content: a string, or its text and image blocks (a screenshot a tool took)
    as parts, for templates that render images in tool messages (Qwen3.5's do)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or a list of content blocks", where)
    for k in range(len(content)):
        names[(msg, k)] = f"{where}[{k}]"
    return [_part(x, f"{where}[{k}]") for k, x in enumerate(content)]


def _user(content: Any, i: int, msgs: list[dict[str, Any]], names: dict[tuple[int, int], str]) -> None:
    """A user message: its tool results as tool messages, then its text and images (if any)."""
    where = f"messages[{i}].content"
    if isinstance(content, str):
        msgs.append({"role": "user", "content": content})
        return
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or a list of content blocks", where)
    parts: list[tuple[str, dict[str, Any]]] = []  # (the block's name, its part)
    for j, b in enumerate(content):
        w = f"{where}[{j}]"
        if isinstance(b, dict) and b.get("type") == "tool_result":
            if not isinstance(b.get("tool_use_id"), str):
                raise bad(f"{w}: a tool_result needs its 'tool_use_id'", f"{w}.tool_use_id")
            content = _result(b.get("content", ""), f"{w}.content", len(msgs), names)
            msgs.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": content})
        else:
            parts.append((w, _part(b, w)))
    if parts:
        for k, (w, _) in enumerate(parts):  # an image's errors name the block it came from
            names[(len(msgs), k)] = w
        msgs.append({"role": "user", "content": [p for _, p in parts]})


def _assistant(content: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or a list of content blocks", where)
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        w = f"{where}[{j}]"
        if kind == "text" and isinstance(b.get("text"), str):
            msg["content"] += b["text"]
        elif kind == "thinking" and isinstance(b.get("thinking"), str):
            msg["reasoning_content"] = msg.get("reasoning_content", "") + b["thinking"]
        elif kind == "redacted_thinking":
            continue  # another provider's encrypted reasoning: nothing to render
        elif kind == "tool_use":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise bad(f"{w}: a tool_use needs 'id' and 'name'", w)
            if not isinstance(b.get("input"), dict):  # as Anthropic's API: an object, always present
                raise bad(f"{w}.input must be an object (the tool's arguments)", f"{w}.input")
            fn = {"name": b["name"], "arguments": json.dumps(b["input"])}
            msg.setdefault("tool_calls", []).append({"id": b["id"], "type": "function", "function": fn})
        else:
            raise bad(f"{w}: {kind!r} blocks are not supported in assistant messages", f"{w}.type")
    return msg


def _messages(req: MessagesRequest, names: dict[tuple[int, int], str]) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    if req.system:
        msgs.append({"role": "system", "content": _text(req.system, "system")})
    if not req.messages:
        raise bad("'messages' must hold at least one message", "messages")
    for i, m in enumerate(req.messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            _user(m.get("content"), i, msgs, names)
        elif role == "assistant":
            msgs.append(_assistant(m.get("content"), i))
        else:
            raise bad(f"messages[{i}].role must be 'user' or 'assistant' (got {role!r})", f"messages[{i}].role")
    return msgs


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") not in (None, "custom"):
            raise bad(
                f"tools[{i}]: {t.get('type')!r} tools run on Anthropic's servers; define it as a custom tool "
                "(name, description, input_schema)",
                f"tools[{i}].type",
            )
        if not isinstance(t.get("name"), str):
            raise bad(f"tools[{i}] needs a 'name'", f"tools[{i}].name")
        if not isinstance(t.get("input_schema"), dict):  # required by Anthropic's API
            raise bad(f"tools[{i}].input_schema is required (a JSON schema object)", f"tools[{i}].input_schema")
        fn = {"name": t["name"], "parameters": t["input_schema"]}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        if t.get("strict") is True:  # structured outputs: under `auto` too, its calls follow the schema
            fn["strict"] = True
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict[str, Any] | None, tools: bool) -> tuple[Any, bool | None]:
    """(chat's tool_choice, parallel_tool_calls); `any` or `tool` with no tools is a 400, as
    Anthropic's API answers it (there is nothing to call)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    if kind in ("any", "tool") and not tools:
        raise bad(f"tool_choice {kind!r} needs 'tools' (there is no tool to call)", "tool_choice")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise bad("tool_choice.type must be auto, any, none, or tool with a 'name'", "tool_choice")


_THINKING_ON = ("enabled", "adaptive", "between_tools")  # the `thinking.type`s that turn it on


def _thinking(req: MessagesRequest) -> dict[str, Any] | None:
    kw = dict(req.chat_template_kwargs or {})
    kind = (req.thinking or {}).get("type")
    if kind in _THINKING_ON:
        kw.setdefault("enable_thinking", True)
    elif kind == "disabled":
        kw.setdefault("enable_thinking", False)
    elif req.thinking is not None:
        raise bad(f"thinking.type must be one of {', '.join((*_THINKING_ON, 'disabled'))}", "thinking.type")
    return kw or None


def _budget(req: MessagesRequest) -> int | None:
    """`thinking.budget_tokens` (with `enabled`): enforced as chat's thinking_token_budget."""
    b = (req.thinking or {}).get("budget_tokens")
    if b is None:
        return None
    if isinstance(b, bool) or not isinstance(b, int) or b < 0:
        raise bad("thinking.budget_tokens must be a non-negative integer", "thinking.budget_tokens")
    if (req.thinking or {}).get("type") == "enabled" and req.max_tokens is not None and b >= req.max_tokens:
        raise bad(f"max_tokens ({req.max_tokens}) must be greater than thinking.budget_tokens ({b})", "max_tokens")
    return b


def _format(req: MessagesRequest) -> dict[str, Any] | None:
    fmt, name = (req.output_config or {}).get("format"), "output_config.format"
    if fmt is None:
        fmt, name = req.output_format, "output_format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad(f"{name} must be {{'type': 'json_schema', 'schema': {{...}}}}", name)
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


_EFFORTS = ("low", "medium", "high")


def _effort(req: MessagesRequest) -> str | None:
    """`output_config.effort`: reaches the template as chat's `reasoning_effort`."""
    e = (req.output_config or {}).get("effort")
    if e is not None and e not in _EFFORTS:
        raise bad(f"output_config.effort must be one of {', '.join(_EFFORTS)}", "output_config.effort")
    return e


def to_chat(req: MessagesRequest) -> ChatRequest:
    """The chat request `req` means (module docstring); ApiError 400 naming a bad field."""
    for name in ("mcp_servers", "container"):
        if getattr(req, name) is not None:
            raise bad(f"'{name}' is not supported by this server", name)
    try:  # chat's bounds, named as this body has them
        check_stops(list(req.stop_sequences or ()))
    except ValueError as e:
        raise bad(str(e).replace("stop", "stop_sequences", 1), "stop_sequences") from None
    names: dict[tuple[int, int], str] = {}
    choice, parallel = _tool_choice(req.tool_choice, bool(req.tools))
    msgs = _messages(req, names)
    last = msgs[-1]
    prefill = last["role"] == "assistant" and not last.get("tool_calls") and bool(last.get("content"))
    body: dict[str, Any] = {
        "model": req.model,
        "messages": msgs,
        "continue_final_message": prefill,
        "add_generation_prompt": not prefill,
        "tools": _tools(req.tools),
        "tool_choice": choice if req.tools else None,
        "parallel_tool_calls": parallel if req.tools else None,
        "max_tokens": req.max_tokens,
        "stop": req.stop_sequences or None,
        "response_format": _format(req),
        "chat_template_kwargs": _thinking(req),
        "thinking_token_budget": _budget(req),
        "reasoning_effort": _effort(req),
    }
    for name in _PASSED:
        body[name] = getattr(req, name)
    chat = parse(ChatRequest, {k: v for k, v in body.items() if v is not None})
    assert isinstance(chat, ChatRequest)
    chat.part_names.update(names)
    chat.name_schemas("tools[{i}].input_schema")
    chat.name_format("output_config.format" if (req.output_config or {}).get("format") is not None else "output_format")
    return chat

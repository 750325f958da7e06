"""The checkpoint's chat template, rendered in the router: the chat request's messages, `tools`,
`chat_template_kwargs`, `add_generation_prompt` and `continue_final_message` go to the template
as transformers' `apply_chat_template` passes them (docs/api.md).

Before rendering: text content parts are joined into a string (no content: ""); image, video, audio and file parts
are refused with a 400 naming `messages[i].content[j].type` (this server does not see them yet, and
content is never dropped silently); an assistant message's `tool_calls[k].function.arguments`,
a JSON string on the wire, becomes the object templates iterate over. After rendering,
`Rendered.think_open` says whether the prompt leaves a `<think>` block open (the output starts
inside the reasoning)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from router.openai_models import ApiError, ChatRequest, bad

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_MEDIA = ("image_url", "image", "input_image", "video_url", "video", "input_audio", "audio", "file")


@dataclass(frozen=True)
class Rendered:
    prompt: str
    think_open: bool  # the prompt ends inside a <think> block


def _raise(msg: str) -> None:
    raise ValueError(msg)


def _tojson(v: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(v, ensure_ascii=False, indent=indent)


class ChatTemplate:
    """One checkpoint's template (a Jinja2 string) in a sandboxed environment shaped like
    transformers' (trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, `tojson`)."""

    def __init__(self, source: str):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)  # some templates date the prompt
        env.filters["tojson"] = _tojson
        self.source = source
        self._tmpl = env.from_string(source)

    def render(self, req: ChatRequest) -> Rendered:
        messages = [_message(i, m.model_dump()) for i, m in enumerate(req.messages)]
        gen, cont = req.add_generation_prompt, req.continue_final_message
        if cont and gen:
            raise bad(
                "'continue_final_message' and 'add_generation_prompt' exclude each other", "continue_final_message"
            )
        if cont and messages[-1]["role"] != "assistant":
            raise bad("'continue_final_message' needs an assistant message last", "continue_final_message")
        mark = f"<pdserve-continue-{uuid.uuid4().hex}>"
        if cont:  # the prompt ends where the final message's text does: mark it, render, cut there
            messages[-1]["content"] = (messages[-1]["content"] or "") + mark
        kwargs = dict(req.chat_template_kwargs or {})
        kwargs.update(messages=messages, tools=req.tools or None, add_generation_prompt=gen)
        try:
            prompt = self._tmpl.render(**kwargs)
        except Exception as e:
            raise bad(f"the chat template refused the messages: {e}", "messages") from None
        if cont:
            at = prompt.rfind(mark)
            if at < 0:
                raise bad("the chat template does not render the final message's text", "continue_final_message")
            prompt = prompt[:at]
        return Rendered(prompt, prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE))


def _message(i: int, d: dict[str, Any]) -> dict[str, Any]:
    """One message as the template sees it (module docstring); ApiError naming the part."""
    content = d.get("content")
    if content is None:  # an assistant turn of calls only: templates test and split content as a string
        d["content"] = ""
    elif isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type")
            if kind in _MEDIA or kind is None and any(k in part for k in _MEDIA):
                raise ApiError(
                    400,
                    f"messages[{i}].content[{j}]: '{kind}' parts are not supported: this server serves text only "
                    "(the part would be dropped, so the request is refused)",
                    param=f"messages[{i}].content[{j}].type",
                )
            if kind != "text" or not isinstance(part.get("text"), str):
                raise bad(
                    f"messages[{i}].content[{j}]: unknown content part (type {kind!r}); expected 'text' with a string",
                    f"messages[{i}].content[{j}].type",
                )
            texts.append(part["text"])
        d["content"] = "".join(texts)
    calls = d.get("tool_calls")
    if calls is not None:
        if d["role"] != "assistant" or not isinstance(calls, list):
            raise bad(f"messages[{i}].tool_calls: a list, on assistant messages only", f"messages[{i}].tool_calls")
        d["tool_calls"] = [_call(i, k, c) for k, c in enumerate(calls)]
    return d


def _call(i: int, k: int, c: Any) -> dict[str, Any]:
    where = f"messages[{i}].tool_calls[{k}]"
    f = c.get("function") if isinstance(c, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise bad(f"{where}: expected {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}", where)
    args = f.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except ValueError as e:
            raise bad(f"{where}.function.arguments is not JSON: {e}", f"{where}.function.arguments") from None
    return dict(c, function=dict(f, arguments=args))

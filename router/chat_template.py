"""The checkpoint's chat template, rendered in the router: the chat request's messages, `tools`,
`chat_template_kwargs`, `add_generation_prompt` and `continue_final_message` go to the template
as transformers' `apply_chat_template` passes them (docs/api.md).

Before rendering: text content parts are joined into a string (no content: ""); a message with
image parts (`image_url`, or Responses' `input_image`) keeps its parts as a list, each image as
`{"type": "image"}` for the template to render its placeholder, and the image's URL is collected
as an ImageRef naming the part (`Rendered.images`, in order); video parts are refused ("video
input is not supported yet"), audio and file parts with a 400 naming `messages[i].content[j].type`
(content is never dropped silently); an assistant message's `tool_calls[k].function.arguments`,
a JSON string on the wire, becomes the object templates iterate over (a custom tool's call:
router/custom_tools.py); a `developer` message
(OpenAI's newer name for the system message, which agent clients send) is a `system` one unless
the template itself names the role. After rendering,
`Rendered.think_open` says whether the prompt leaves a `<think>` block open (the output starts
inside the reasoning)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from router.custom_tools import history_call
from router.images.decode import ImageRefused
from router.images.prepare import ImageRef
from router.openai_models import ApiError, ChatRequest, bad

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_IMAGES = ("image_url", "input_image")
_VIDEO = ("video_url", "video", "input_video")
_MEDIA = ("image", "input_audio", "audio", "file", "input_file")


@dataclass(frozen=True)
class Rendered:
    prompt: str
    think_open: bool  # the prompt ends inside a <think> block
    images: tuple[ImageRef, ...] = ()  # the image parts, in message and part order


def _raise(msg: str) -> None:
    raise ValueError(msg)


def _tojson(v: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(v, ensure_ascii=False, indent=indent)


class ChatTemplate:
    """One checkpoint's template (a Jinja2 string) in a sandboxed environment shaped like
    transformers' (trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, `tojson`)."""

    def __init__(self, source: str, defaults: dict[str, Any] | None = None):
        """`defaults`: --default-chat-template-kwargs, under every request's own chat_template_kwargs."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)  # some templates date the prompt
        env.filters["tojson"] = _tojson
        self.source = source
        self.defaults = dict(defaults or {})
        self._tmpl = env.from_string(source)
        self._developer = "developer" in source  # the template has a role of that name: it is passed on

    def render(self, req: ChatRequest) -> Rendered:
        images: list[ImageRef] = []
        messages = [_message(i, m.model_dump(), images, req.part_names) for i, m in enumerate(req.messages)]
        if not self._developer:
            for m in messages:
                if m.get("role") == "developer":
                    m["role"] = "system"
        cont = req.continue_final_message
        gen = req.adds_generation_prompt
        if cont and gen:
            raise bad(
                "'continue_final_message' and 'add_generation_prompt' exclude each other: send "
                "'add_generation_prompt': false, or leave it out",
                "continue_final_message",
            )
        if cont and messages[-1]["role"] != "assistant":
            raise bad("'continue_final_message' needs an assistant message last", "continue_final_message")
        mark = f"<pdserve-continue-{uuid.uuid4().hex}>"
        if cont:  # the prompt ends where the final message's text does: mark it, render, cut there
            messages[-1]["content"] = (messages[-1]["content"] or "") + mark
        kwargs = dict(req.chat_template_kwargs or {})
        if req.enable_thinking is not None:  # Qwen's own API takes the switch at the top level
            kwargs.setdefault("enable_thinking", req.enable_thinking)
        if req.reasoning_effort is not None:  # for templates that read it; "none" also turns thinking off
            kwargs.setdefault("reasoning_effort", req.reasoning_effort)
            if req.reasoning_effort == "none":
                kwargs.setdefault("enable_thinking", False)
        for k, v in self.defaults.items():  # the server's, under the request's (vLLM's order)
            kwargs.setdefault(k, v)
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
        return Rendered(prompt, prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE), tuple(images))


def _message(i: int, d: dict[str, Any], images: list[ImageRef], names: dict[tuple[int, int], str]) -> dict[str, Any]:
    """One message as the template sees it (module docstring), its images appended to `images`;
    ApiError naming the part. `names`: a part's name in the request the client sent, where that
    was not a chat request (Responses' `input[i].content[j]`)."""
    content = d.get("content")
    if content is None:  # an assistant turn of calls only: templates test and split content as a string
        d["content"] = ""
    elif isinstance(content, list):
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            where = names.get((i, j), f"messages[{i}].content[{j}]")
            kind = part.get("type")
            if kind in _IMAGES:
                images.append(ImageRef(where, url=_image_url(part, where)))
                parts.append({"type": "image"})
                continue
            if kind in _VIDEO:
                raise ImageRefused("video", f"{where}: video input is not supported yet")
            if kind in _MEDIA or kind is None and any(k in part for k in _MEDIA + _IMAGES):
                raise ApiError(
                    400,
                    f"{where}: '{kind}' parts are not supported (text and image_url only; the part would be "
                    "dropped, so the request is refused)",
                    param=f"{where}.type",
                )
            if kind == "text" and not isinstance(part.get("text"), str):
                got = type(part.get("text")).__name__ if "text" in part else "nothing"
                raise bad(f"{where}.text must be a string (got {got})", f"{where}.text")
            if kind != "text":
                raise bad(
                    f"{where}: unknown content part (type {kind!r}); expected 'text' with a string or 'image_url'",
                    f"{where}.type",
                )
            parts.append({"type": "text", "text": part["text"]})
        if any(p["type"] == "image" for p in parts):
            d["content"] = parts
        else:
            d["content"] = "".join(p["text"] for p in parts)
    calls = d.get("tool_calls")
    if calls is not None:
        if d["role"] != "assistant" or not isinstance(calls, list):
            raise bad(f"messages[{i}].tool_calls: a list, on assistant messages only", f"messages[{i}].tool_calls")
        d["tool_calls"] = [_call(i, k, c) for k, c in enumerate(calls)]
    return d


def _image_url(part: dict[str, Any], where: str) -> str:
    """An image part's URL: chat's `{"image_url": {"url": ...}}` or Responses' `{"image_url": "..."}`."""
    u = part.get("image_url")
    if isinstance(u, dict):
        if u.get("detail") not in (None, "auto", "low", "high"):  # OpenAI's values (all served alike)
            raise bad(f"{where}.image_url.detail must be 'auto', 'low' or 'high'", f"{where}.image_url.detail")
        u = u.get("url")
    if not isinstance(u, str) or not u:
        raise bad(f"{where}: an image part needs image_url.url, a data: URL (or an http(s) URL where allowed)", where)
    return u


def _call(i: int, k: int, c: Any) -> dict[str, Any]:
    where = f"messages[{i}].tool_calls[{k}]"
    if isinstance(c, dict) and c.get("type") == "custom":
        c = history_call(c, where)
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

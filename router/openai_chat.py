"""A chat request's prompt, constraint and output parsers: the checkpoint's template renders the
messages (router/chat_template.py), router/tool_choice.py turns tools, tool_choice and
response_format into what is parsed and constrained (custom tools as functions of one input,
router/custom_tools.py), and each choice gets a ChatOutput
(router/parsers/output.py). The parsers are chosen from the template's text unless the router's
`--reasoning-parser` / `--tool-call-parser` say otherwise."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from proto import pb
from router import thinking_budget
from router.chat_template import THINK_CLOSE, THINK_OPEN, ChatTemplate
from router.custom_tools import as_functions
from router.images.prepare import ImageRef
from router.openai_models import ChatRequest, bad
from router.parsers.output import ChatOutput
from router.parsers.tool_calls import ToolFormat, detect_format
from router.tool_choice import plan


@dataclass(frozen=True)
class ChatPrep:
    prompt: str
    constraint: pb.Constraint | None
    output: Callable[[], ChatOutput]  # a fresh one per choice
    images: tuple[ImageRef, ...] = ()  # the messages' image parts, in prompt order
    echo: str = ""  # with `echo`: the text each choice's content starts with (`echoed`)


def echoed(req: ChatRequest) -> str:
    """vLLM's chat `echo`: the last message's text when its role is the answer's (the assistant's
    with a generation prompt, else the last message's own: a continued assistant message), put
    before each choice's content; "" otherwise. Text parts are joined by newlines, as vLLM's."""
    last = req.messages[-1]
    role = "assistant" if req.adds_generation_prompt else last.role
    if not req.echo or last.role != role or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(str(p.get("text", "")) for p in last.content if p.get("type") == "text")


class ChatFront:
    """The parts of the checkpoint's tokenizer and the router's options chat requests need."""

    def __init__(
        self, tok, reasoning: str = "auto", tool_format: str = "auto", template: str = "", kwargs: dict | None = None
    ):
        """`template`: --chat-template's text, in place of the tokenizer's ("" for the tokenizer's);
        `kwargs`: --default-chat-template-kwargs."""
        source: str = template or (tok.chat_template if tok is not None else None) or ""
        self.template = ChatTemplate(source, kwargs) if source else None
        self.think_close = tok.token_to_id(THINK_CLOSE) if tok is not None else None
        if reasoning == "auto":
            self.reasoning = THINK_OPEN in source and THINK_CLOSE in source
        else:
            self.reasoning = reasoning == "think"
        self.fmt: ToolFormat | None = None
        if tool_format == "auto":
            self.fmt = detect_format(source)
        elif tool_format in ("xml", "json"):
            self.fmt = tool_format  # type: ignore[assignment]

    def prepare(self, req: ChatRequest) -> ChatPrep:
        if self.template is None:
            raise bad("this model's tokenizer has no chat_template", "messages")
        req, customs = as_functions(req)
        r = self.template.render(req)
        think_close = self.think_close if r.think_open else None
        p = plan(req, self.fmt, think_close, customs)
        tools = req.tools if p.parse else None
        out = partial(ChatOutput, self.fmt if p.parse else None, tools, self.reasoning, r.think_open, tuple(customs))
        constraint = p.constraint
        if req.thinking_token_budget is not None and think_close is not None:
            constraint = thinking_budget.constrain(constraint, think_close, req.thinking_token_budget)
        return ChatPrep(r.prompt, constraint, out, r.images, echoed(req))

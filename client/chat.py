"""Chat through the router (`Generation.Chat`, router/grpc_chat.py): an OpenAI chat completions
body in (`messages`, `tools`, `tool_choice`, `response_format`, sampling fields, ...), rendered with
the checkpoint's chat template on the router; out, OpenAI's chunks as dicts (`index`, `delta` with
`content`, `reasoning_content`, `tool_calls`, `finish_reason`), then `{"usage": ...}`, folded by
`ChatResult` into one message per choice as OpenAI's whole answer has it. A router that fails
mid-answer (UNAVAILABLE) is replaced by the next, which continues each choice after the tokens
received (`ChatProgress`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import grpc

from client.types import PdserveError
from proto import pb

# The chat body's fields besides `model` and `messages`: router/openai_models.py ChatRequest's
# (tests/client/test_sdk_chat_fields.py keeps the two the same). Another name given to `chat` is a
# TypeError, a misspelling the router would ignore; `extra_body` sends any field as it is.
CHAT_FIELDS = frozenset(
    """add_generation_prompt allowed_token_ids bad_words best_of cache_salt chat_template
    chat_template_kwargs continue_final_message ebnf echo enable_thinking frequency_penalty
    function_call functions guided_choice guided_decoding_backend guided_grammar guided_json
    guided_regex guided_whitespace_pattern ignore_eos include_stop_str_in_output json_schema
    logit_bias logprobs max_completion_tokens max_tokens media_io_kwargs min_p min_tokens
    mm_processor_kwargs n num_speculative_tokens parallel_tool_calls presence_penalty priority
    prompt_logprobs reasoning_effort regex repetition_penalty response_format return_token_ids
    return_tokens_as_token_ids seed skip_special_tokens stop stop_token_ids stream stream_options
    structured_outputs suffix temperature thinking_token_budget tool_choice tools top_k top_logprobs
    top_p truncate_prompt_tokens use_beam_search""".split()
)


def check_fields(fields: dict[str, Any], extra_body: Any) -> None:
    """TypeError naming the `fields` that are not chat request fields (send those in `extra_body`)."""
    unknown = sorted(set(fields) - CHAT_FIELDS)
    if unknown:
        raise TypeError(
            f"chat got unknown field(s) {', '.join(unknown)}: not chat request fields (docs/api.md); "
            "send other fields with extra_body={...}"
        )
    if extra_body is not None and not isinstance(extra_body, dict):
        raise TypeError(f"extra_body must be a dict of body fields, not {type(extra_body).__name__}")


def chat_request(
    messages: list[dict[str, Any]], model: str, fields: dict[str, Any], extra_body: dict[str, Any] | None = None
) -> pb.ChatRequest:
    """The Chat call's body: `fields` (checked by `check_fields`), `extra_body`'s (any names, as
    OpenAI's SDK sends them), then `model` and `messages`."""
    return pb.ChatRequest(body_json=json.dumps({**fields, **(extra_body or {}), "model": model, "messages": messages}))


class ChatProgress:
    """What a chat stream has received, per choice: its tokens and whether it finished; the
    request to make on the next router when the current one fails (ChatRequest.resume), so the
    answer goes on from there (client/routers.py)."""

    def __init__(self, req: pb.ChatRequest, routers: int, cur: int) -> None:
        self.req, self.i, self.left = req, cur, routers - 1
        self.tokens: dict[int, list[int]] = {}
        self.finished: set[int] = set()

    def call(self, routers: Any, timeout: float | None) -> Any:
        """The Chat call on the router to try now (a resume after a failure)."""
        return routers.stubs[self.i % len(routers.stubs)].Chat(self.request(), timeout=timeout, metadata=routers.md)

    def add(self, m: pb.ChatChunk) -> dict[str, Any]:
        chunk = chunk_of(m)
        if "index" in chunk:
            self.tokens.setdefault(chunk["index"], []).extend(m.token_ids)
            if chunk.get("finish_reason"):
                self.finished.add(chunk["index"])
        return chunk

    def failed(self, e: grpc.RpcError, routers: Any) -> None:
        """After the call failed: the next router becomes current (the caller calls again), or
        PdserveError when none is left or the failure is not UNAVAILABLE."""
        if self.left <= 0 or e.code() != grpc.StatusCode.UNAVAILABLE:
            raise PdserveError.from_rpc(e) from None
        self.left -= 1
        self.i += 1
        routers.use(self.i)

    def request(self) -> pb.ChatRequest:
        if not self.tokens and not self.finished:
            return self.req
        r = pb.ChatRequest(body_json=self.req.body_json)
        for i in sorted(set(self.tokens) | self.finished):
            r.resume.append(pb.ChatResume(index=i, token_ids=self.tokens.get(i, []), finished=i in self.finished))
        return r


def chunk_of(m: pb.ChatChunk) -> dict[str, Any]:
    """A choice's chunk, or `{"usage": ...}` (the last message)."""
    return json.loads(m.choice_json) if m.choice_json else {"usage": json.loads(m.usage_json or "{}")}


@dataclass
class ChatChoice:
    index: int
    message: dict[str, Any] = field(default_factory=lambda: {"role": "assistant", "content": None})
    finish_reason: str | None = None


@dataclass
class ChatResult:
    """The whole answer: `choices` (each `message` as OpenAI's: `content`, `reasoning_content`,
    `tool_calls`), `usage`; `message` is the first choice's."""

    choices: list[ChatChoice] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)

    @property
    def message(self) -> dict[str, Any]:
        return self.choices[0].message

    def add(self, chunk: dict[str, Any]) -> None:
        if "usage" in chunk and "delta" not in chunk:
            self.usage = chunk["usage"]
            return
        i = chunk["index"]
        while len(self.choices) <= i:
            self.choices.append(ChatChoice(len(self.choices)))
        c = self.choices[i]
        c.finish_reason = chunk.get("finish_reason") or c.finish_reason
        d, msg = chunk.get("delta") or {}, c.message
        for k in ("content", "reasoning_content"):
            if d.get(k):
                msg[k] = (msg.get(k) or "") + d[k]
        for tc in d.get("tool_calls") or ():
            calls = msg.setdefault("tool_calls", [])
            kind = tc.get("type") or calls[tc["index"]]["type"]
            part, text = tc.get(kind) or {}, "input" if kind == "custom" else "arguments"
            if "id" in tc:
                calls.append({"id": tc["id"], "type": kind, kind: {"name": part.get("name", ""), text: ""}})
            calls[tc["index"]][kind][text] += part.get(text, "")

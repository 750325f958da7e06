"""Responses input items as chat messages (router/responses_request.py): a `function_call_output`
answers a call made before it, in this request's items or the stored conversation's; one whose
`call_id` no earlier call has is a 400 naming it, as OpenAI's API answers it."""

from __future__ import annotations

import pytest

from router.openai_models import ApiError
from router.responses_request import ResponsesRequest, to_chat

CALL = {"type": "function_call", "name": "f", "call_id": "call_1", "arguments": "{}"}
USER = {"role": "user", "content": "go"}


def _out(call_id):
    return {"type": "function_call_output", "call_id": call_id, "output": "42"}


def _req(items) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": items})


def test_an_output_after_its_call_is_a_tool_message():
    chat = to_chat(_req([USER, CALL, _out("call_1")]))
    tool = chat.messages[-1]
    assert tool.role == "tool" and tool.tool_call_id == "call_1" and tool.content == "42"


def test_an_output_may_answer_a_stored_call():
    chat = to_chat(_req([_out("call_1")]), prior=[USER, CALL])
    assert chat.messages[-1].tool_call_id == "call_1"


@pytest.mark.parametrize("call_id", ["call_2", None])
def test_an_output_with_no_call_before_it_is_a_400(call_id):
    for items in ([USER, CALL, _out(call_id)], [USER, _out("call_1"), CALL]):
        with pytest.raises(ApiError) as ei:
            to_chat(_req(items))
        e = ei.value
        assert e.status == 400 and e.param.endswith("].call_id") and "no tool call" in str(e), e


@pytest.mark.parametrize("call_id", [["call_1"], {"id": 1}, 7])
def test_a_call_id_that_is_not_a_string_is_a_400(call_id):
    """OpenAI types call_id as a string: another value is a 400 naming the item (a list was a 500)."""
    for items in ([USER, {**CALL, "call_id": call_id}], [USER, CALL, _out(call_id)]):
        with pytest.raises(ApiError) as ei:
            to_chat(_req(items))
        assert ei.value.status == 400 and ei.value.param.startswith("input["), ei.value

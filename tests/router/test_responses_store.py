"""The router's store of responses (router/responses_store.py): a continued conversation is the
earlier input, then the earlier output; the least recently used go first beyond the byte limit and
a chain outlives the responses before it; input_items pages as OpenAI's list does; unknown ids
and a disabled store are refusals naming the field."""

from __future__ import annotations

import json

import pytest

from router.openai_models import ApiError
from router.responses_store import ResponseStore, input_items


def _resp(rid: str, text: str) -> dict:
    out = [
        {"type": "message", "id": f"msg_{rid}", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
    ]
    return {"id": rid, "object": "response", "output": out}


def _size(resp: dict, own: list) -> int:  # as the store counts, computed here on its own
    return len(json.dumps(resp, separators=(",", ":"))) + len(json.dumps(own, separators=(",", ":")))


def test_a_conversation_is_the_input_then_the_output_and_outlives_its_start():
    s = ResponseStore(1 << 20)
    a_in = input_items("hi")
    assert a_in[0]["type"] == "message" and a_in[0]["content"] == [{"type": "input_text", "text": "hi"}]
    assert a_in[0]["id"].startswith("msg_")
    s.put(_resp("a", "hello"), [], a_in)
    conv = s.conversation("a")
    assert [it["id"] for it in conv] == [a_in[0]["id"], "msg_a"]
    sent = [{"role": "user", "content": "more"}, {"type": "function_call_output", "call_id": "c", "output": "x"}]
    b_in = input_items(sent)
    assert b_in[1]["id"].startswith("item_") and all("id" not in it for it in sent)  # the caller's dicts unchanged
    s.put(_resp("b", "ok"), conv, b_in)
    assert s.delete("a") and not s.delete("a")
    assert [it["id"] for it in s.conversation("b")] == [a_in[0]["id"], "msg_a", b_in[0]["id"], b_in[1]["id"], "msg_b"]
    with pytest.raises(ApiError) as e:
        s.conversation("a")
    assert (e.value.status, e.value.param, e.value.code) == (400, "previous_response_id", "previous_response_not_found")


def test_least_recently_used_go_first_within_the_byte_limit():
    one = _size(_resp("r0", "x" * 100), input_items("y"))
    s = ResponseStore(3 * one + one // 2)  # room for three
    for i in range(3):
        assert s.put(_resp(f"r{i}", "x" * 100), [], input_items("y"))
    assert s.get("r0") is not None  # used: r1 is now the oldest
    s.put(_resp("r3", "x" * 100), [], input_items("y"))
    assert [r for r in ("r0", "r1", "r2", "r3") if s.get(r) is not None] == ["r0", "r2", "r3"]
    assert s.bytes <= s.max_bytes and len(s) == 3
    assert not s.put(_resp("big", "x" * (4 * one)), [], [])  # alone over the limit: not kept, nothing dropped
    assert len(s) == 3


def test_input_items_page_as_openai_lists():
    s = ResponseStore(1 << 20)
    own = input_items([{"role": "user", "content": str(i)} for i in range(5)])
    s.put(_resp("r", "z"), [], own)
    ids = [it["id"] for it in own]
    p = s.page("r", 2, "desc", None)
    assert [it["id"] for it in p["data"]] == ids[::-1][:2] and p["has_more"] and p["first_id"] == ids[4]
    p = s.page("r", 2, "asc", ids[2])
    assert [it["id"] for it in p["data"]] == ids[3:5] and not p["has_more"] and p["last_id"] == ids[4]
    with pytest.raises(ApiError) as e:
        s.page("r", 2, "asc", "nope")
    assert e.value.param == "after"
    with pytest.raises(ApiError) as e:
        s.page("gone", 2, "asc", None)
    assert e.value.status == 404


def test_a_store_of_zero_refuses_continuations():
    s = ResponseStore(0)
    assert not s.enabled
    with pytest.raises(ApiError) as e:
        s.conversation("r")
    assert e.value.status == 400 and "--responses-store-mb 0" in e.value.message
    with pytest.raises(ApiError):
        ResponseStore(1 << 20).conversation(123)

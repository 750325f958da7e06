"""A router whose checkpoint has no tokenizer.json serves token-id prompts; what needs text from
ids (logprobs, prompt_logprobs) is a 400 naming the field, never a 500."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers.front_door import post, start


@pytest.fixture(scope="module")
def bare_door(ckpt, tmp_path_factory):
    bare = tmp_path_factory.mktemp("no-tokenizer")
    shutil.copy(f"{ckpt}/config.json", bare / "config.json")
    r, fake, srv, hb, port = start(bare)
    yield r, port
    hb.stop()
    r.stop(0)
    srv.stop(0)


def _body(**kw) -> bytes:
    return json.dumps({"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, **kw}).encode()


def test_token_ids_are_served_without_a_tokenizer(bare_door):
    r, _ = bare_door
    status, out = post(r.http_port, _body())
    assert status == 200, out
    assert out["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_fields_that_need_text_are_a_400_naming_them(bare_door, field):
    r, _ = bare_door
    status, out = post(r.http_port, _body(**{field: 1}))
    assert status == 400, out
    assert field in out["error"]["message"] and "tokenizer" in out["error"]["message"], out

"""The router's --chat-template (router/config.py): a template, from a file or given as text,
renders every chat request in place of the checkpoint's: the node gets the ids of what
transformers' `apply_chat_template` renders with that template; one that is neither a readable
file nor a template, or that does not compile, stops the router's start with a ValueError
naming the flag; a per-request `chat_template` stays a 400."""

from __future__ import annotations

import json

import pytest

from tests.helpers.front_door import post, start

TEMPLATE = (
    "{%- for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n{%- endfor %}"
    "{%- if add_generation_prompt %}[ASSISTANT] {%- endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.mark.parametrize("as_file", [True, False])
def test_the_flags_template_renders_chat_requests(ckpt, tmp_path, as_file):
    from transformers import AutoTokenizer

    value = TEMPLATE
    if as_file:
        (tmp_path / "t.jinja").write_text(TEMPLATE)
        value = str(tmp_path / "t.jinja")
    tok = AutoTokenizer.from_pretrained(ckpt)
    text = tok.apply_chat_template(MESSAGES, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False)
    assert text != tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    r, fake, srv, hb, _ = start(ckpt, chat_template=value)
    try:
        body = json.dumps({"messages": MESSAGES, "max_tokens": 2}).encode()
        status, out = post(r.http_port, body, "/v1/chat/completions")
        assert status == 200, out
        assert list(fake.last.prompt_token_ids) == tok.encode(text, add_special_tokens=False)
        body = json.dumps({"messages": MESSAGES, "max_tokens": 2, "chat_template": TEMPLATE}).encode()
        status, out = post(r.http_port, body, "/v1/chat/completions")
        assert (
            status == 400 and out["error"]["param"] == "chat_template" and "--chat-template" in out["error"]["message"]
        )
    finally:
        hb.stop()
        r.stop(0)
        srv.stop(0)


@pytest.mark.parametrize(
    "value,words",
    [("/no/such/template.jinja", "not a readable file"), ("{% for m in messages %}", "does not compile")],
)
def test_a_bad_template_stops_the_start(value, words):
    from router.config import RouterConfig

    with pytest.raises(ValueError, match=words) as e:
        RouterConfig(model="m", chat_template=value)
    assert "--chat-template" in str(e.value)

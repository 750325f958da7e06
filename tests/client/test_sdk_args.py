"""The SDK's argument checks (client/args.py, client/types.py `build_request`), with no server: a
badly typed argument raises at once, before any call, a TypeError or ValueError naming the
parameter and what it takes; the wire's own errors (KeyError, protobuf's TypeError, "Value out of
range", a str of a file name taken as a list of one-letter files) no longer reach the caller."""

from __future__ import annotations

import asyncio

import pytest

from client import AsyncClient, Client
from client.types import build_request
from proto import pb

BAD = [
    (dict(priority="urgent"), ValueError, "priority must be 'interactive' or 'batch'"),
    (dict(priority=1), TypeError, "priority must be"),
    (dict(prompt=[1, 2, 3]), TypeError, "token ids go in prompt_token_ids="),
    (dict(max_tokens="5"), TypeError, "max_tokens must be an integer"),
    (dict(max_tokens=5.5), TypeError, "max_tokens must be an integer"),
    (dict(max_tokens=2**40), ValueError, "max_tokens must be an integer in [-2147483648, 2147483647]"),
    (dict(seed=2**70), ValueError, "seed must be an integer in"),
    (dict(temperature="hot"), TypeError, "temperature must be a number"),
    (dict(top_p=[1]), TypeError, "top_p must be a number"),
    (dict(images=b"\x89PNG", prompt_token_ids=None, prompt="x"), None, None),  # one image alone: accepted
    (dict(images=[3]), TypeError, "images[0] must be bytes, a file path or a URL"),
    (dict(images=7), TypeError, "images must be a list of images"),
    (dict(stop_token_ids=5), TypeError, "stop_token_ids must be a list of token ids"),
    (dict(stop_token_ids=[1, "2"]), TypeError, "stop_token_ids[1] must be an integer"),
    (dict(prompt_token_ids=[1, 2**31]), ValueError, "prompt_token_ids[1] must be an integer in"),
    (dict(prompt_token_ids="1 2 3"), TypeError, "prompt_token_ids must be a list of token ids"),
    (dict(stop=5), TypeError, "stop must be a str or a list of str"),
    (dict(stop=["a", 5]), TypeError, "stop[1] must be a str"),
    (dict(ignore_eos="yes"), TypeError, "ignore_eos must be True or False"),
    (dict(skip_special_tokens=0), TypeError, "skip_special_tokens must be True or False"),
    (dict(logit_bias=[(1, 2.0)]), TypeError, "logit_bias must be a dict"),
    (dict(logit_bias={"x": 1}), TypeError, "logit_bias's token ids must be an integer"),
    (dict(logit_bias={1: "big"}), TypeError, "logit_bias[1] must be a number"),
    (dict(cache_salt=5), TypeError, "cache_salt must be a str"),
    (dict(request_id=5), TypeError, "request_id must be a str"),
    (dict(admission_timeout_s="5"), TypeError, "admission_timeout_s must be a number"),
]


def _kw(kw: dict) -> dict:
    return {"prompt_token_ids": [1, 2, 3], **kw} if "prompt" not in kw else kw


@pytest.mark.parametrize("kw, exc, words", BAD)
def test_badly_typed_arguments_raise_naming_the_parameter(kw, exc, words):
    if exc is None:
        build_request(**_kw(kw))
        return
    with pytest.raises(exc) as e:
        build_request(**_kw(kw))
    assert words in str(e.value), e.value


def test_both_clients_raise_before_any_call():
    with Client("127.0.0.1:1", timeout=5) as c, pytest.raises(ValueError, match="priority"):
        c.generate(prompt_token_ids=[1], priority="urgent")

    async def aio() -> None:
        async with AsyncClient("127.0.0.1:1", timeout=5) as c:
            with pytest.raises(TypeError, match="max_tokens"):
                await c.generate(prompt_token_ids=[1], max_tokens="5")

    asyncio.run(aio())


def test_one_image_alone_is_a_list_of_one(tmp_path):
    f = tmp_path / "img.png"
    f.write_bytes(b"\x89PNG-ish")
    for one in (str(f), f, f.read_bytes(), "data:image/png;base64,AAAA"):
        req = build_request(prompt="x", images=one)
        assert len(req.images) == 1
    assert build_request(prompt="x", images=str(f)).images[0].data == b"\x89PNG-ish"
    assert build_request(prompt="x", images=[f, f]).images[1].data == b"\x89PNG-ish"


def test_well_typed_values_go_on_the_wire_as_before():
    import numpy as np

    r = build_request(
        prompt_token_ids=np.array([5, 6]),
        max_tokens=np.int64(3),
        temperature=1,
        seed=2**63 - 1,
        stop="\n",
        logit_bias={"7": -100, 8: 5},
        priority="batch",
        top_k=None,
        skip_special_tokens=False,
    )
    assert list(r.prompt_token_ids) == [5, 6] and r.sampling.max_tokens == 3 and r.sampling.seed == 2**63 - 1
    assert r.sampling.temperature == 1.0 and list(r.sampling.stop) == ["\n"] and r.priority == pb.PRIORITY_BATCH
    assert dict(r.sampling.logit_bias) == {7: -100.0, 8: 5.0} and r.sampling.skip_special_tokens is False

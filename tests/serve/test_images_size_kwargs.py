"""`mm_processor_kwargs` through `pdserve up` (router + one prefill node + one decode node; and
with an encode node, `--encode 1`) on the tiny vision-language checkpoint, over HTTP chat and the
SDK's generate (prefilled on the prefill node, or with prompt logprobs on the decode node): the
same image asked for at different pixel bounds, one request after another and several at once,
gets for each the prompt token count and the greedy answer transformers gives on the same image
processed with those keyword arguments. Each sizing is its own entry in the prefill node's
encoder cache and prefix cache (the image's identity includes the bounds), and the encode node
encodes each sizing into a landing slot of its own: were they keyed by the pixels alone, a
request would be given the embeddings or the cached pages of the image sized another way."""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest

from tests.helpers import images as im
from tests.helpers import vl_ckpt as vl
from tests.helpers.serve_harness import Up, flags, log_url

NEW = 8
SIZINGS = [None, {"max_pixels": 16384}, {"size": {"shortest_edge": 4096, "longest_edge": 32768}}]


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory):
    return vl.make(tmp_path_factory.mktemp("vl") / "ckpt", vl.SPEC_VL["qwen3_5"])


@pytest.fixture(scope="module", params=[0, 1], ids=["no-pool", "encode-pool"])
def vl_up(vl_model, request):
    opts = flags(dtype="float32", decode=1, prefill=1, encode=request.param, local_prefill_threshold=0, http_port=0)
    up = Up("--model", vl_model, *opts, "--reasoning-parser", "none", "--tool-call-parser", "none")
    yield up, bool(request.param)
    assert up.stop() == 0, up.output()


def _messages(image: bytes, parts: str) -> list[dict]:
    url = {"type": "image_url", "image_url": {"url": im.data_url(image)}}
    return [{"role": "user", "content": [{"type": "text", "text": parts}, url]}]


def _reference(model: str, image: bytes, text: str, kwargs: dict | None) -> tuple[int, str]:
    """(prompt tokens, greedy answer) of transformers with its processor called with `kwargs`."""
    n, tokens, _ = _reference_ids(model, image, text, kwargs)
    from transformers import AutoTokenizer

    return n, str(AutoTokenizer.from_pretrained(model).decode(tokens, skip_special_tokens=True))


def _reference_ids(model: str, image: bytes, text: str, kwargs: dict | None) -> tuple[int, list[int], str]:
    """(prompt tokens, transformers' greedy token ids, the rendered prompt)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    hf_msgs: list = [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image"}]}]
    rendered = str(tok.apply_chat_template(hf_msgs, tokenize=False, add_generation_prompt=True))
    ids, inputs = vl.expand(model, tok.encode(rendered, add_special_tokens=False), [image], kwargs)
    return len(ids), vl.hf_greedy(model, ids, inputs, NEW, kwargs=kwargs), rendered


def _ask(url: str, image: bytes, text: str, kwargs: dict | None) -> tuple[int, str]:
    body: dict = {"model": "ckpt", "messages": _messages(image, text), "max_tokens": NEW, "temperature": 0.0}
    body["ignore_eos"] = True
    if kwargs is not None:
        body["mm_processor_kwargs"] = kwargs
    req = urllib.request.Request(
        url + "/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    return out["usage"]["prompt_tokens"], out["choices"][0]["message"]["content"]


def test_one_image_at_several_sizes_one_after_another(vl_up, vl_model):
    vl_up, pool = vl_up
    url = log_url(vl_up, r"OpenAI-compatible HTTP on (http://\S+/v1)")
    image, text = vl.png(240, 180, seed=5), "Describe this picture:"
    want = [_reference(vl_model, image, text, kw) for kw in SIZINGS]
    assert len({n for n, _ in want}) == len(SIZINGS), want  # each sizing has its own token count
    for kw, ref in zip(SIZINGS + SIZINGS[::-1], want + want[::-1], strict=True):  # each after another sizing
        assert _ask(url, image, text, kw) == ref, kw
    if pool:  # each sizing encoded there once, the repeats cached on the prefill node
        assert vl_up.output().count("encoded here") == len(SIZINGS), vl_up.output()[-4000:]


def test_one_image_at_several_sizes_at_once(vl_up, vl_model):
    vl_up, _ = vl_up
    url = log_url(vl_up, r"OpenAI-compatible HTTP on (http://\S+/v1)")
    image, text = vl.png(200, 150, seed=6), "What is in it?"
    want = [_reference(vl_model, image, text, kw) for kw in SIZINGS]
    got: dict[int, tuple[int, str]] = {}

    def one(k: int) -> None:
        got[k] = _ask(url, image, text, SIZINGS[k % len(SIZINGS)])

    threads = [threading.Thread(target=one, args=(k,)) for k in range(2 * len(SIZINGS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert {k: got.get(k) for k in range(len(threads))} == {k: want[k % len(SIZINGS)] for k in range(len(threads))}


def test_the_sdk_on_either_node(vl_up, vl_model):
    """The SDK's generate (GenerateRequest.image_size): prefilled on the prefill node, and, with
    prompt logprobs, on the decode node, which sizes the image by the bounds on its DecodeRequest."""
    from client import Client

    vl_up, _ = vl_up
    image = vl.png(220, 160, seed=7)
    with Client(vl_up.address, timeout=120) as c:
        for kw in SIZINGS:
            n, want, prompt = _reference_ids(vl_model, image, "Look:", kw)  # the prompt holds one placeholder
            for extra, where in (({}, "prefill-0"), ({"prompt_logprobs": 0}, "")):
                r = c.generate(
                    prompt=prompt,
                    images=[image],
                    max_tokens=NEW,
                    temperature=0.0,
                    ignore_eos=True,
                    mm_processor_kwargs=kw,
                    **extra,
                )
                assert (r.prompt_tokens, r.token_ids, r.prefill_node) == (n, want, where), (kw, extra)

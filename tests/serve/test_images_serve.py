"""Images through `pdserve up` (router + one prefill node + one decode node, every prompt through
the prefill node) on the tiny vision-language checkpoint: OpenAI chat (and Anthropic messages) with one image, two of
different sizes, an image in an earlier turn and text only answers what transformers' `generate`
answers on the same processed inputs (the same text over HTTP, the same tokens through the SDK,
prefilled on the prefill node or, with logprobs, on the decode node; usage counting the
expanded prompt), also from `pdserve generate --image`; two images of one size with the same text
each get their own answer and the first again is a prefix-cache hit; every bad image (corrupt bytes, a 50-megapixel image, an SVG
and a PDF body, an http URL with fetching off, a video part, too many images) is a 400 naming the
part, after which the cluster serves on and both nodes' pages and slots are back to their start."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.helpers import images as im
from tests.helpers import vl_ckpt as vl
from tests.helpers.serve_harness import Up, decode_stats, flags, log_url, node_info, prefill_stats, wait_for


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory):
    return vl.make(tmp_path_factory.mktemp("vl") / "ckpt", vl.SPEC_VL["qwen3_5"])


@pytest.fixture(scope="module")
def vl_up(vl_model):
    opts = flags(
        dtype="float32",
        decode=1,
        prefill=1,
        local_prefill_threshold=0,
        http_port=0,
        max_images_per_request=2,
        reasoning_parser="none",  # the content is the whole output's text
        tool_call_parser="none",
        prefix_snapshot_interval=16,  # short prompts leave GDN snapshots to hit
    )
    up = Up("--model", vl_model, *opts)
    yield up
    assert up.stop() == 0, up.output()


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        url + "/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _chat(parts: list[dict]) -> dict:
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]}]
    return {"model": "ckpt", "messages": msgs, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


OK = _image(im.data_url(im.encoded(48, 40, seed=1)))
BAD = [
    ([_image(im.data_url(bytes(range(256)) * 8))], "messages[0].content[1]: not an image in a format"),
    ([_image(im.data_url(im.solid(8000, 6500)))], "messages[0].content[1]: image is 52.0 megapixels (8000x6500)"),
    ([_image(im.data_url(im.SVG, "image/svg+xml"))], "messages[0].content[1]: not an image in a format"),
    ([_image(im.data_url(im.PDF, "application/pdf"))], "messages[0].content[1]: a data: URL of media type"),
    ([OK, _image("http://127.0.0.1:9/cat.png")], "messages[0].content[2]: image URLs are not fetched"),
    ([{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}], "video input is not supported yet"),
    ([OK, OK, OK], "messages[0].content[3]: the request has 3 images, the limit is 2"),
]


def _all_free(c) -> bool:
    return (c.free_blocks, c.free_slots, c.running) == (c.total_blocks, c.total_slots, 0)


def test_bad_images_are_refused_naming_the_part_and_nothing_leaks(vl_up):
    url = log_url(vl_up, r"OpenAI-compatible HTTP on (http://\S+/v1)")
    d, p = node_info(vl_up.address, "decode-0"), node_info(vl_up.address, "prefill-0")
    start = decode_stats(d.address).capacity
    assert _all_free(start) and _all_free(prefill_stats(p.address).capacity)
    for parts, words in BAD:
        status, out = _post(url, _chat(parts))
        assert status == 400 and words in out["error"]["message"], (words, status, out)
        assert out["error"]["param"] == out["error"]["message"].split(":")[0]
    import grpc

    from client import IMAGE_PLACEHOLDER, Client, PdserveError

    with Client(vl_up.address, timeout=60) as c, pytest.raises(PdserveError) as e:  # gRPC: empty bytes named so
        c.generate(prompt=f"What is {IMAGE_PLACEHOLDER}?", images=[b""], max_tokens=2)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.message.startswith("images[0] is empty")
    status, out = _post(url, {**_chat([]), "messages": [{"role": "user", "content": "Hello"}]})
    assert status == 200 and out["choices"][0]["finish_reason"] == "length", out  # the cluster serves on
    assert out["usage"]["completion_tokens"] == 4
    wait_for(lambda: decode_stats(d.address).capacity == start, 20, "the decode node's pages and slots back")
    wait_for(lambda: _all_free(prefill_stats(p.address).capacity), 20, "the prefill node's memory back")
    assert "Traceback" not in vl_up.output()


NEW = 12
A, B = vl.png(64, 48, seed=1), vl.png(40, 100, seed=2)  # different sizes: 12 and 16 image tokens


def _text(t: str) -> dict:
    return {"type": "text", "text": t}


CASES = {
    "one image": [{"role": "user", "content": [_text("What is in "), _image(im.data_url(A)), _text("?")]}],
    "two images": [{"role": "user", "content": [_image(im.data_url(A)), _text(" or "), _image(im.data_url(B))]}],
    "earlier turn": [
        {"role": "user", "content": [_image(im.data_url(B)), _text("Describe it.")]},
        {"role": "assistant", "content": "A picture."},
        {"role": "user", "content": "And the colours?"},
    ],
    "text only": [{"role": "user", "content": "Hello there, how are you?"}],
}


def _reference(model: str, tok, msgs: list[dict]) -> tuple[str, list[int], list[bytes], list[int]]:
    """transformers' rendering (each image part as {"type": "image"}), its ids expanded by the
    image processor's grids, and its greedy tokens."""
    hf_msgs, images = [], []
    for m in msgs:
        parts = m["content"]
        if isinstance(parts, list):
            for p in parts:
                if p["type"] == "image_url":
                    images.append(A if p["image_url"]["url"] == im.data_url(A) else B)
            parts = [{"type": "image"} if p["type"] == "image_url" else p for p in parts]
        hf_msgs.append({**m, "content": parts})
    text = tok.apply_chat_template(hf_msgs, tokenize=False, add_generation_prompt=True)
    ids, inputs = vl.expand(model, tok.encode(text, add_special_tokens=False), images)
    return text, ids, images, vl.hf_greedy(model, ids, inputs, NEW)


def test_chat_with_images_equals_transformers(vl_up, vl_model):
    from transformers import AutoTokenizer

    from client import Client

    tok = AutoTokenizer.from_pretrained(vl_model)
    url = log_url(vl_up, r"OpenAI-compatible HTTP on (http://\S+/v1)")
    with Client(vl_up.address, timeout=120) as c:
        for name, msgs in CASES.items():
            text, ids, images, want = _reference(vl_model, tok, msgs)
            body = {"model": "ckpt", "messages": msgs, "max_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
            status, out = _post(url, body)
            assert status == 200, (name, out)
            assert out["choices"][0]["message"]["content"] == tok.decode(want, skip_special_tokens=True), name
            assert (out["usage"]["prompt_tokens"], out["usage"]["completion_tokens"]) == (len(ids), NEW), name
            r = c.generate(prompt=text, images=images, max_tokens=NEW, temperature=0.0, ignore_eos=True)
            assert r.token_ids == want, f"{name}: the SDK's tokens differ from transformers'"
            assert r.prompt_tokens == len(ids) and r.prefill_node == "prefill-0", name
            # with prompt logprobs the decode node prefills the prompt itself, images and all
            r = c.generate(
                prompt=text, images=images, max_tokens=NEW, temperature=0.0, ignore_eos=True, prompt_logprobs=0
            )
            assert r.token_ids == want and r.prefill_node == "", f"{name}: prefilled on the decode node"


def test_anthropic_image_blocks_equal_transformers(vl_up, vl_model):
    """/v1/messages with `image` blocks (base64 sources, one image and two of different sizes):
    the text block is transformers' greedy answer on the same processed inputs, and
    count_tokens is the expanded prompt's length."""
    import base64

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vl_model)
    root = log_url(vl_up, r"OpenAI-compatible HTTP on (http://\S+)/v1")

    def block(p: dict) -> dict:
        if p["type"] == "text":
            return p
        data = A if p["image_url"]["url"] == im.data_url(A) else B
        return {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(data).decode()},
        }

    for name in ("one image", "two images"):
        msgs = CASES[name]
        _, ids, _, want = _reference(vl_model, tok, msgs)
        turns = [{"role": m["role"], "content": [block(p) for p in m["content"]]} for m in msgs]
        body = {"model": "ckpt", "messages": turns, "max_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
        req = urllib.request.Request(
            root + "/v1/messages", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.loads(r.read())
        assert out["content"] == [{"type": "text", "text": tok.decode(want, skip_special_tokens=True)}], name
        assert out["usage"]["input_tokens"] + out["usage"]["cache_read_input_tokens"] == len(ids), name
        req = urllib.request.Request(
            root + "/v1/messages/count_tokens", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            assert json.loads(r.read()) == {"input_tokens": len(ids)}, name


def test_cli_generate_with_an_image(vl_up, vl_model, tmp_path):
    import os
    import subprocess
    import sys

    from tests.helpers.serve_harness import ROOT

    (tmp_path / "a.png").write_bytes(A)
    gen = [sys.executable, "-m", "router.cli", "generate", "--addr", vl_up.address, "--image", str(tmp_path / "a.png")]
    run = dict(capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120, cwd=ROOT)
    r = subprocess.run([*gen, "What is it?", "--max-tokens", "3", "--temperature", "0", "--ignore-eos"], **run)
    assert r.returncode == 0 and "3 tokens, length" in r.stderr, r.stderr
    assert wait_for(lambda: [ln for ln in vl_up.lines if "(1 image)" in ln and "pdserve.router" in ln], 10, "log")
    # --chat: the image as a chat image part before the text, in the chat template (transformers' count)
    from transformers import AutoTokenizer

    hf = [{"role": "user", "content": [{"type": "image"}, _text("What is it?")]}]
    tok = AutoTokenizer.from_pretrained(vl_model)
    ids, _ = vl.expand(vl_model, tok.apply_chat_template(hf, add_generation_prompt=True, return_dict=False), [A])
    r = subprocess.run(
        [*gen, "What is it?", "--chat", "--max-tokens", "3", "--temperature", "0", "--ignore-eos"], **run
    )
    assert r.returncode == 0 and f"[{len(ids)} prompt tokens, 3 new, length" in r.stderr, r.stderr


def test_two_images_of_one_size_are_told_apart_and_a_repeat_hits_the_cache(vl_up, vl_model):
    """The same text with two different images of the same size (the same token ids): each
    answer is its own image's; the first image again is a prefix-cache hit with its answer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vl_model)
    url = log_url(vl_up, r"OpenAI-compatible HTTP on (http://\S+/v1)")
    c, d = vl.png(64, 64, seed=21), vl.png(64, 64, seed=22)
    outs = []
    for img in (c, d, c):
        msgs = [{"role": "user", "content": [_text("Which one is this? "), _image(im.data_url(img))]}]
        hf = [{"role": "user", "content": [_text("Which one is this? "), {"type": "image"}]}]
        ids, inputs = vl.expand(
            vl_model, tok.apply_chat_template(hf, add_generation_prompt=True, return_dict=False), [img]
        )
        body = {"model": "ckpt", "messages": msgs, "max_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
        status, out = _post(url, body)
        assert status == 200, out
        assert out["choices"][0]["message"]["content"] == tok.decode(
            vl.hf_greedy(vl_model, ids, inputs, NEW), skip_special_tokens=True
        )
        outs.append(out)
    cached = [(o["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for o in outs]
    assert cached[2] >= 16 and cached[1] < cached[2], cached  # d shares only the text before the image with c

"""vLLM's per-request `mm_processor_kwargs` (min_pixels, max_pixels, or transformers' `size`
{shortest_edge, longest_edge}) through the router in process against a fake decode node
(tests/router/test_images.py's): the same image under different bounds gets the grid, and so the
number of prompt tokens, that transformers' own image processor gives with those keyword
arguments, an identity (pixel_hash) of its own per sizing, and the bounds on the node message,
which the node's own check of the image accepts; keys the processor's size does not take, and
values it would refuse, are a 400 naming the key, with no node call. The SDK's generate (gRPC
GenerateRequest.image_size) takes the same kwargs. Before, the field was a 400 whatever it held."""

from __future__ import annotations

import json
import warnings

import pytest

from tests.helpers import images as im
from tests.router.test_front_door import post
from tests.router.test_images import _router

IMAGE = im.encoded(300, 200, seed=3)  # the tiny processor's own bounds (4096 to 65536 pixels) make it 6 x 10 merged


@pytest.fixture(scope="module")
def vl_dir(ckpt, tmp_path_factory):
    return im.vl_router_dir(ckpt, tmp_path_factory.mktemp("vl"))


@pytest.fixture(scope="module")
def vl(vl_dir):
    r, fake, port, stop = _router(vl_dir, max_image_pixels=1_000_000)
    yield r, fake, port
    stop()


def _body(kwargs: dict | None) -> dict:
    content = [{"type": "image_url", "image_url": {"url": im.data_url(IMAGE)}}, {"type": "text", "text": "What?"}]
    body: dict = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    if kwargs is not None:
        body["mm_processor_kwargs"] = kwargs
    return body


def _hf_grid(vl_dir: str, kwargs: dict) -> tuple[int, ...]:
    """transformers' grid for IMAGE with the same keyword arguments the client sent."""
    from transformers import AutoImageProcessor

    from engine.vision.inputs import decode_rgb

    with warnings.catch_warnings():  # min_pixels / max_pixels at call time are deprecated in transformers 5
        warnings.simplefilter("ignore", FutureWarning)
        got = AutoImageProcessor.from_pretrained(vl_dir)(images=[decode_rgb(IMAGE)], **kwargs)
    return tuple(int(x) for x in got["image_grid_thw"][0])


SIZINGS = [
    {},
    {"max_pixels": 16384},
    {"min_pixels": 32768, "max_pixels": 65536},
    {"size": {"shortest_edge": 4096, "longest_edge": 8192}},
    {"size": {"shortest_edge": 4096, "longest_edge": 65536}, "max_pixels": 20000},  # max_pixels wins, as in HF
]


def test_each_sizing_gets_transformers_grid_and_an_identity_of_its_own(vl, vl_dir):
    from engine.vision.inputs import ImageInput
    from engine.vision.processing import check_image

    r, fake, _ = vl
    pad = r.service.images.spec.image_token_id
    hashes, counts = set(), set()
    for kw in SIZINGS:
        before = len(fake.requests)
        status, out = post(r.http_port, json.dumps(_body(kw)).encode(), "/v1/chat/completions")
        assert status == 200, (kw, out)
        (req,) = fake.requests[before:]
        (got,) = req.images
        grid = _hf_grid(vl_dir, kw)
        t, h, w = grid
        n = t * h * w // 4
        assert tuple(got.grid_thw) == grid, kw
        assert list(req.prompt_token_ids).count(pad) == n, kw  # the prompt carries the image's tokens
        assert out["usage"]["prompt_tokens"] == len(req.prompt_token_ids), kw
        bounds = None if not kw else (got.min_pixels, got.max_pixels)
        assert (bounds is None) == ((got.min_pixels, got.max_pixels) == (0, 0)), kw
        check_image(vl_dir, 0, ImageInput(got.data, got.pixel_hash, got.offset, grid, bounds))  # the node agrees
        hashes.add(got.pixel_hash)
        counts.add(n)
    assert len(hashes) == len(SIZINGS)  # every sizing is its own cache entry
    assert len(counts) >= 4, counts


def test_the_checkpoints_own_bounds_are_the_plain_image(vl):
    """Bounds equal to the checkpoint's name the image as no kwargs do (its cached pages serve both)."""
    r, fake, _ = vl
    seen = []
    for kw in (None, {"min_pixels": im.MIN_PIXELS, "max_pixels": im.MAX_PIXELS}):
        before = len(fake.requests)
        status, out = post(r.http_port, json.dumps(_body(kw)).encode(), "/v1/chat/completions")
        assert status == 200, out
        (got,) = fake.requests[before].images
        seen.append((got.pixel_hash, got.min_pixels, got.max_pixels))
    assert seen[0] == seen[1] and seen[0][1:] == (0, 0)


BAD = [
    ({"fps": 2}, "key 'fps' is not supported"),
    ({"max_pixels": 16384, "do_resize": False}, "key 'do_resize' is not supported"),
    ({"max_pixels": "big"}, "mm_processor_kwargs.max_pixels must be a positive integer"),
    ({"min_pixels": 0}, "mm_processor_kwargs.min_pixels must be a positive integer"),
    ({"max_pixels": True}, "mm_processor_kwargs.max_pixels must be a positive integer"),
    ({"min_pixels": 30000, "max_pixels": 20000}, "min_pixels 30000 is above max_pixels 20000"),
    ({"min_pixels": 2_000_000, "max_pixels": 4_000_000}, "above this router's limit of 1000000 pixels"),
    ({"size": {"longest_edge": 8192}}, "size must be an object with exactly shortest_edge and longest_edge"),
    ([1, 2], "mm_processor_kwargs must be an object"),
]


@pytest.mark.parametrize("kwargs,words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_what_the_processor_size_does_not_take_is_a_400_naming_it(vl, kwargs, words):
    r, fake, _ = vl
    before = len(fake.requests)
    status, out = post(r.http_port, json.dumps(_body(kwargs)).encode(), "/v1/chat/completions")
    assert status == 400 and words in out["error"]["message"], out
    assert out["error"]["param"] == "mm_processor_kwargs" and len(fake.requests) == before
    # completions take no images, but the field is read the same way
    body = {"model": "m", "prompt": "Hi", "max_tokens": 2, "mm_processor_kwargs": kwargs}
    status, out = post(r.http_port, json.dumps(body).encode(), "/v1/completions")
    assert status == 400 and words in out["error"]["message"], out


def test_the_sdks_generate_takes_them_as_image_size(vl, vl_dir):
    import grpc

    from client import IMAGE_PLACEHOLDER, Client, PdserveError

    r, fake, port = vl
    prompt = f"Describe {IMAGE_PLACEHOLDER} please"
    with Client(f"127.0.0.1:{port}", timeout=30) as c:
        for kw in SIZINGS[1:]:
            before = len(fake.requests)
            res = c.generate(prompt=prompt, images=[IMAGE], max_tokens=2, mm_processor_kwargs=kw)
            (req,) = fake.requests[before:]
            assert tuple(req.images[0].grid_thw) == _hf_grid(vl_dir, kw), kw
            assert res.prompt_tokens == len(req.prompt_token_ids), kw
        with pytest.raises(ValueError, match="mm_processor_kwargs key 'fps' is not supported"):
            c.generate(prompt=prompt, images=[IMAGE], max_tokens=2, mm_processor_kwargs={"fps": 1})
        with pytest.raises(PdserveError) as e:
            c.generate(
                prompt=prompt,
                images=[IMAGE],
                max_tokens=2,
                mm_processor_kwargs={"min_pixels": 9000, "max_pixels": 5000},
            )
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.message == "image_size: min_pixels 9000 is above max_pixels 5000", e.value.message

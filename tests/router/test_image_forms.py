"""Image encodings as phones and apps send them, through the router in process against a fake
decode node (tests/router/test_images.py's): a photo stored sideways with an EXIF orientation
tag reaches the node with the grid and pixel hash of the upright image, as transformers'
`load_image` (and vLLM) decode the same bytes, and the node's own check of those bytes passes; in
a Responses message with an `input_image`, a bad part (video, file, a text that is not a string,
an unknown `detail`) is a 400 naming that part, with no node call; so is vLLM's per-request
media_io_kwargs, named as a field (mm_processor_kwargs: tests/router/test_image_size_kwargs.py)."""

from __future__ import annotations

import hashlib
import io
import json

import numpy as np
import pytest
from PIL import Image

from tests.helpers import images as im
from tests.router.test_front_door import post
from tests.router.test_images import _router


@pytest.fixture(scope="module")
def vl_dir(ckpt, tmp_path_factory):
    return im.vl_router_dir(ckpt, tmp_path_factory.mktemp("vl"))


@pytest.fixture(scope="module")
def vl(vl_dir):
    r, fake, port, stop = _router(vl_dir)
    yield r, fake
    stop()


def _turned(orientation: int, fmt: str) -> bytes:
    """A 120 x 40 picture of random pixels stored with EXIF `orientation` (6: shown turned 90
    degrees clockwise, a phone's portrait photo; 8: 90 counter-clockwise; 3: upside down)."""
    px = np.random.default_rng(orientation).integers(0, 256, (40, 120, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, format=fmt, exif=exif.tobytes())
    return buf.getvalue()


@pytest.mark.parametrize("orientation,fmt", [(6, "JPEG"), (8, "PNG"), (3, "JPEG")])
def test_a_photo_with_an_exif_orientation_is_seen_upright(vl, vl_dir, orientation, fmt):
    """Before, the router and the nodes used the stored pixels: a portrait photo was seen lying
    on its side, with its grid's height and width swapped against transformers' and vLLM's."""
    from transformers import AutoImageProcessor
    from transformers.image_utils import load_image

    from engine.vision.inputs import ImageInput
    from engine.vision.processing import check_image

    r, fake = vl
    url = im.data_url(_turned(orientation, fmt), f"image/{fmt.lower()}")
    ref = load_image(url)  # transformers: the bytes, turned upright, as RGB
    grid = tuple(int(x) for x in AutoImageProcessor.from_pretrained(vl_dir)(images=[ref])["image_grid_thw"][0])
    upright = ref.size == (120, 40) if orientation == 3 else ref.size == (40, 120)
    assert upright, ref.size
    body = {
        "model": "m",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
    }
    before = len(fake.requests)
    status, out = post(r.http_port, json.dumps(body).encode(), "/v1/chat/completions")
    assert status == 200, out
    (req,) = fake.requests[before:]
    (got,) = req.images
    assert tuple(got.grid_thw) == grid
    size = ref.width.to_bytes(4, "little") + ref.height.to_bytes(4, "little")
    assert got.pixel_hash == hashlib.sha256(size + ref.tobytes()).digest()
    check_image(vl_dir, 0, ImageInput(got.data, got.pixel_hash, got.offset, grid))  # the node decodes it so too


VIDEO = "'input_video' parts are not supported (input_text, output_text and input_image only)"
RESPONSES_BAD = [  # a Responses user message with an image: each bad part is named by its own index
    (
        [{"type": "input_text", "text": "x"}, {"type": "input_video", "video_url": "v.mp4"}],
        "input[0].content[2]",
        VIDEO,
    ),
    ([{"type": "input_file", "file_data": "x"}], "input[0].content[1]", "'input_file' parts are not supported"),
    ([{"type": "input_text", "text": 5}], "input[0].content[1].text", " must be a string"),
    ([{"type": "input_image", "image_url": "IMG", "detail": "ultra"}], "input[0].content[1].detail", " must be 'auto'"),
]


@pytest.mark.parametrize("after,where,words", RESPONSES_BAD, ids=["video", "file", "text", "detail"])
def test_a_responses_message_with_an_image_names_its_bad_part(vl, after, where, words):
    """Before, every bad part after an `input_image` was named `content[0]` (the image) and the
    message said the parts could be text only."""
    r, fake = vl
    url = im.data_url(im.encoded(40, 30, seed=2))
    parts = [{"type": "input_image", "image_url": url}] + [
        {**p, "image_url": url} if p.get("image_url") == "IMG" else p for p in after
    ]
    body = {"model": "m", "max_output_tokens": 2, "input": [{"role": "user", "content": parts}]}
    before = len(fake.requests)
    status, out = post(r.http_port, json.dumps(body).encode(), "/v1/responses")
    assert status == 400 and out["error"]["message"].startswith(where) and words in out["error"]["message"], out
    param = where if where.endswith(("text", "detail")) else where + ".type"
    assert out["error"]["param"] == param and len(fake.requests) == before
    parts[1:] = [{"type": "input_text", "text": "What is it?"}]  # the same image with text is served
    body["input"] = [{"role": "user", "content": parts}]
    status, out = post(r.http_port, json.dumps(body).encode(), "/v1/responses")
    assert status == 200 and len(fake.requests) == before + 1, out


@pytest.mark.parametrize("field,value", [("media_io_kwargs", {"image": {}})])
def test_vllms_per_request_image_options_are_refused_by_name(vl, field, value):
    """vLLM's per-request image decoding options (media_io_kwargs): before, ignored with a log
    line; now a 400 naming the field, and empty is as unsent."""
    r, fake = vl
    url = im.data_url(im.encoded(300, 200, seed=3))
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    before = len(fake.requests)
    body = {"model": "m", "max_tokens": 2, "messages": msgs, field: value}
    status, out = post(r.http_port, json.dumps(body).encode(), "/v1/chat/completions")
    assert status == 400 and out["error"]["param"] == field and f"'{field}' is not supported" in out["error"]["message"]
    assert len(fake.requests) == before
    status, out = post(r.http_port, json.dumps({**body, field: {}}).encode(), "/v1/chat/completions")
    assert status == 200 and len(fake.requests) == before + 1, out

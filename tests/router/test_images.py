"""Images on the router, in process against a fake decode node that records what it is sent: the
patch grid equals transformers' Qwen2-VL image processor's on the same image; a chat image (data
URL) reaches the node as an ImageInput whose placeholder run, offset and hash match transformers'
template, processor and the decoded pixels, and usage counts the expanded prompt; every bad image
(corrupt, 50 megapixels, SVG / PDF, a URL with fetching off, video, too many, a stray placeholder,
a model with no vision tower) is a 400 naming the part, counted by reason, with no node call, and
the router serves on; with --allow-image-urls an image is fetched from a loopback server, and a
body too large, a slow one, a hang and redirect loops are refused."""

from __future__ import annotations

import hashlib
import json
import threading
import time

import pytest
from PIL import Image

from proto import pb, rpc
from serving.rpc import start_server
from tests.helpers import images as im
from tests.helpers.fake_node import FakeDecode, decode_info, heartbeat
from tests.helpers.serve_harness import wait_for
from tests.router.test_front_door import post


class Recording(FakeDecode):
    """A fake decode node that keeps every DecodeRequest."""

    def __init__(self):
        super().__init__([5, 6, 7], delay_s=0.0)
        self.requests: list[pb.DecodeRequest] = []

    def Generate(self, request, context):
        self.requests.append(request)
        yield from super().Generate(request, context)


def _router(model: str, **cfg):
    from router.server import RouterConfig, serve

    fake = Recording()
    srv, nport, _ = start_server("127.0.0.1:0", lambda s: rpc.add_DecodeNodeServicer_to_server(fake, s), ["DecodeNode"])
    conf = RouterConfig(model=model, heartbeat_interval_s=0.1, dead_after_s=1.0, http_port=0, **cfg)
    r, port = serve("127.0.0.1:0", conf)
    hb = heartbeat(f"127.0.0.1:{port}", decode_info(f"127.0.0.1:{nport}", max_model_len=4096, vocab_size=1024), 0.1)
    wait_for(lambda: r.registry.live(pb.NODE_KIND_DECODE), 10, "the fake node registered")

    def stop() -> None:
        hb.stop()
        r.stop(0)
        srv.stop(0)

    return r, fake, port, stop


@pytest.fixture(scope="module")
def vl_dir(ckpt, tmp_path_factory):
    return im.vl_router_dir(ckpt, tmp_path_factory.mktemp("vl"))


@pytest.fixture(scope="module")
def vl(vl_dir):
    r, fake, port, stop = _router(vl_dir, max_images_per_request=3, max_image_pixels=25_000_000)
    yield r, fake, port
    stop()


@pytest.fixture(scope="module")
def fetching(vl_dir):
    r, fake, port, stop = _router(
        vl_dir,
        allow_image_urls=True,
        image_url_timeout_s=1.5,
        image_url_max_bytes=200_000,
        image_url_max_redirects=2,
        max_body_bytes=300_000,
        allow_private_image_urls=True,  # the test's server is on loopback
    )
    srv = im.ImageServer(im.encoded(200, 200, seed=5), big=300_000)  # a PNG of 120 KB
    yield r, fake, srv
    srv.stop()
    stop()


def _chat(parts: list[dict], **kw) -> bytes:
    msgs = [{"role": "system", "content": "Look."}, {"role": "user", "content": parts}]
    return json.dumps({"model": "m", "messages": msgs, "max_tokens": 2, **kw}).encode()


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _refused(r, reason: str) -> float:
    return r.service.metrics.registry.get_sample_value("pdserve_router_images_refused_total", {"reason": reason}) or 0


def _rgb_sha(data: bytes) -> bytes:
    import io

    with Image.open(io.BytesIO(data)) as x:
        rgb = x.convert("RGB")
        return hashlib.sha256(
            rgb.width.to_bytes(4, "little") + rgb.height.to_bytes(4, "little") + rgb.tobytes()
        ).digest()


SIZES = [(1, 1), (10, 500), (32, 32), (33, 95), (100, 77), (255, 257), (640, 480), (1000, 999), (4000, 20), (3, 599)]


def test_grid_equals_transformers_processor(vl_dir):
    from transformers import AutoImageProcessor

    from engine.tokenizer import Tokenizer
    from router.images.vision import VisionSpec

    spec = VisionSpec.load(vl_dir, Tokenizer(vl_dir).token_to_id("<|image_pad|>"))
    proc = AutoImageProcessor.from_pretrained(vl_dir)
    assert spec is not None and (spec.patch_size, spec.min_pixels, spec.max_pixels) == (
        16,
        im.MIN_PIXELS,
        im.MAX_PIXELS,
    )
    for w, h in SIZES:
        want = tuple(int(x) for x in proc(images=[Image.new("RGB", (w, h))])["image_grid_thw"][0])
        assert spec.grid(w, h) == want, (w, h)


def test_the_processor_config_variants(vl_dir, tmp_path):
    """Top-level min_pixels / max_pixels override `size` (as transformers' processor reads them);
    an unknown processor, or an image_token_id that is not the tokenizer's, takes no images."""
    import shutil

    from transformers import AutoImageProcessor

    from router.images.vision import VisionSpec

    d = tmp_path / "ck"
    shutil.copytree(vl_dir, d)
    pad = json.loads((d / "config.json").read_text())["image_token_id"]
    cfg = json.loads((d / "preprocessor_config.json").read_text())
    (d / "preprocessor_config.json").write_text(json.dumps({**cfg, "min_pixels": 128 * 128, "max_pixels": 160 * 160}))
    spec, proc = VisionSpec.load(d, pad), AutoImageProcessor.from_pretrained(d)
    assert spec is not None
    for w, h in SIZES:
        assert spec.grid(w, h) == tuple(int(x) for x in proc(images=[Image.new("RGB", (w, h))])["image_grid_thw"][0])
    assert VisionSpec.load(d, pad + 1) is None
    (d / "preprocessor_config.json").write_text(json.dumps({**cfg, "image_processor_type": "SiglipImageProcessor"}))
    assert VisionSpec.load(d, pad) is None


def test_a_chat_image_reaches_the_node_expanded(vl, vl_dir):
    from transformers import AutoImageProcessor, AutoTokenizer

    r, fake, port = vl
    a, b = im.encoded(100, 77, seed=1), im.encoded(33, 95, seed=2, fmt="JPEG")
    parts = [{"type": "text", "text": "What is in "}, _image(im.data_url(a)), {"type": "text", "text": " and "}]
    parts.append(_image(im.data_url(b, "image/jpeg")))
    before = len(fake.requests)
    status, out = post(r.http_port, _chat(parts), "/v1/chat/completions")
    assert status == 200, out
    (req,) = fake.requests[before:]
    # the reference: transformers' template and tokenizer, each placeholder expanded by its processor's grid
    tok, proc = AutoTokenizer.from_pretrained(vl_dir), AutoImageProcessor.from_pretrained(vl_dir)
    hf_parts = [{"type": "text", "text": "What is in "}, {"type": "image"}, {"type": "text", "text": " and "}]
    msgs = [{"role": "system", "content": "Look."}, {"role": "user", "content": [*hf_parts, {"type": "image"}]}]
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    grids = [
        tuple(int(x) for x in g)
        for g in proc(images=[Image.open(__import__("io").BytesIO(x)) for x in (a, b)])["image_grid_thw"]
    ]
    want, offsets = [], []
    for t in ids:
        if t == pad:
            offsets.append(len(want))
            g = grids[len(offsets) - 1]
            want += [pad] * (g[0] * g[1] * g[2] // 4)
        else:
            want.append(t)
    assert list(req.prompt_token_ids) == want
    assert [i.offset for i in req.images] == offsets
    assert [tuple(i.grid_thw) for i in req.images] == grids
    assert [i.data for i in req.images] == [a, b]
    assert [i.pixel_hash for i in req.images] == [_rgb_sha(a), _rgb_sha(b)]
    assert out["usage"]["prompt_tokens"] == len(want)
    reg = r.service.metrics.registry
    assert reg.get_sample_value("pdserve_router_image_tokens_total") >= len(want) - len(ids) + 2


def test_tokenize_counts_a_chat_images_tokens_as_the_processor_sizes_it(vl, vl_dir):
    """vLLM's /tokenize takes chat messages with images: each placeholder is expanded to as many
    tokens as transformers' processor makes of that image (its grid / merge^2)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    r, fake, _ = vl
    a = im.encoded(100, 77, seed=1)
    before = len(fake.requests)
    body = json.loads(_chat([_image(im.data_url(a)), {"type": "text", "text": "What is it?"}]))
    status, out = post(
        r.http_port, json.dumps({"messages": body["messages"], "return_token_strs": True}).encode(), "/tokenize"
    )
    assert status == 200, out
    tok, proc = AutoTokenizer.from_pretrained(vl_dir), AutoImageProcessor.from_pretrained(vl_dir)
    msgs = [
        {"role": "system", "content": "Look."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
    ]
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    t, h, w = (int(x) for x in proc(images=[Image.open(__import__("io").BytesIO(a))])["image_grid_thw"][0])
    at = ids.index(pad)
    want = ids[:at] + [pad] * (t * h * w // 4) + ids[at + 1 :]
    assert out["tokens"] == want and out["count"] == len(want)
    assert out["token_strs"] == tok.convert_ids_to_tokens(want)
    assert len(fake.requests) == before  # counted on the router: no node ran
    bad = json.loads(_chat([_image("data:image/png;base64,AAAA")]))
    status, out = post(r.http_port, json.dumps({"messages": bad["messages"]}).encode(), "/tokenize")
    assert status == 400 and out["error"]["message"].startswith("messages[1].content[0]"), out


def test_the_same_pixels_hash_the_same_and_different_ones_do_not(vl):
    from router.images.decode import decode

    png, webp = im.encoded(50, 40, seed=3), im.encoded(50, 40, seed=3, fmt="WEBP")
    other = im.encoded(50, 40, seed=4)
    assert png != webp and decode(png, 10**6).pixel_hash == decode(webp, 10**6).pixel_hash == _rgb_sha(png)
    assert decode(other, 10**6).pixel_hash != decode(png, 10**6).pixel_hash
    rgba = im.encoded(20, 20, seed=6, mode="RGBA")
    assert decode(rgba, 10**6).pixel_hash == _rgb_sha(rgba)


def _transparent() -> dict[str, bytes]:
    """Images with transparency: hidden pixels hold colours a flattening would show."""
    import io

    import numpy as np

    px = np.random.default_rng(9).integers(0, 256, (40, 48, 4), dtype=np.uint8)
    px[:, :20, 3] = 0  # a transparent band, a half-transparent one, the rest opaque
    px[:, 20:30, 3] = 128
    px[:, 30:, 3] = 255
    out: dict[str, bytes] = {}
    for name, img, fmt in (
        ("rgba", Image.fromarray(px, "RGBA"), "PNG"),
        ("la", Image.fromarray(px, "RGBA").convert("LA"), "PNG"),
        ("p_png", Image.fromarray(px[..., :3]).convert("P"), "PNG"),
        ("p_gif", Image.fromarray(px[..., :3]).convert("P"), "GIF"),
    ):
        buf = io.BytesIO()
        img.save(buf, format=fmt, **({"transparency": 0} if name.startswith("p_") else {}))
        out[name] = buf.getvalue()
    return out


@pytest.mark.parametrize("name", ["rgba", "la", "p_png", "p_gif"])
def test_a_transparent_image_hashes_as_the_processor_sees_it_and_the_node_takes_it(vl_dir, name):
    """The router's pixel hash of an image with transparency is that of transformers' convert_to_rgb
    (composited onto white), the pixels the node decodes: the node's check then passes (it refused
    every such image with 'pixel_hash is not the SHA-256 of its decoded pixels')."""
    import io

    from transformers.image_transforms import convert_to_rgb

    from engine.tokenizer import Tokenizer
    from engine.vision.inputs import ImageInput
    from engine.vision.processing import check_image
    from router.images.decode import decode
    from router.images.prepare import _decode
    from router.images.vision import VisionSpec

    data = _transparent()[name]
    with Image.open(io.BytesIO(data)) as x:
        rgb = convert_to_rgb(x, return_numpy=True)
    want = hashlib.sha256(rgb.shape[1].to_bytes(4, "little") + rgb.shape[0].to_bytes(4, "little") + rgb.tobytes())
    assert decode(data, 10**6).pixel_hash == want.digest()
    spec = VisionSpec.load(vl_dir, Tokenizer(vl_dir).token_to_id("<|image_pad|>"))
    assert spec is not None
    p = _decode("messages[0].content[0]", data, spec, 10**6)
    check_image(vl_dir, 0, ImageInput(p.data, p.pixel_hash, 0, p.grid_thw))  # no ValueError


def test_grpc_images(vl, tmp_path):
    from client import Client, PdserveError

    r, fake, port = vl
    a = im.encoded(64, 64, seed=7)
    big = im.encoded(1400, 1300, seed=8)  # past gRPC's default 4 MiB message, within --max-body-bytes
    prompt = "Describe <|vision_start|><|image_pad|><|vision_end|> please"
    before = len(fake.requests)
    with Client(f"127.0.0.1:{port}", timeout=30) as c:
        res = c.generate(prompt=prompt, images=[a], max_tokens=2)
        (req,) = fake.requests[before:]
        assert [tuple(i.grid_thw) for i in req.images] == [(1, 4, 4)] and req.images[0].data == a
        assert res.prompt_tokens == len(req.prompt_token_ids) == len(r.service.tokenizer.encode(prompt)) + 3
        assert len(big) > 4 << 20
        (tmp_path / "a.png").write_bytes(a)
        c.generate(prompt=prompt * 3, images=[big, im.data_url(a), tmp_path / "a.png"], max_tokens=2)
        assert [i.data for i in fake.requests[-1].images] == [big, a, a]
        for kw, words in [
            (dict(prompt=prompt, images=[b"junk"]), "images[0]: not an image"),
            (dict(prompt=prompt, images=["http://127.0.0.1:9/x.png"]), "images[0]: image URLs are not fetched"),
            (dict(prompt="no placeholder", images=[a]), "images[0]: the prompt holds 0 <|image_pad|>"),
            (dict(prompt_token_ids=[1, 2], images=[a]), "images need a text prompt"),
            (dict(prompt=prompt), "prompt: the prompt holds 1 <|image_pad|> placeholder(s) for 0 image(s)"),
        ]:
            with pytest.raises(PdserveError) as e:
                c.generate(max_tokens=2, **kw)
            assert e.value.code.name == "INVALID_ARGUMENT" and words in e.value.message, (kw, e.value.message)
    assert len(fake.requests) == before + 2


OK = im.encoded(40, 30, seed=9)
BAD = [
    ("random bytes", [_image(im.data_url(bytes(range(256)) * 4))], "format", "messages[1].content[0]: not an image"),
    ("corrupt", [_image(im.data_url(b"\x89PNG\r\n\x1a\nnot really"))], "corrupt", "messages[1].content[0]: the image is"),
    ("truncated", [_image(im.data_url(OK[: len(OK) // 2]))], "corrupt", "messages[1].content[0]: the image is corrupt"),
    ("bad base64", [_image("data:image/png;base64,!!!")], "corrupt", "messages[1].content[0]: the data: URL's base64"),
    ("50 megapixels", [_image(im.data_url(im.solid(8000, 6500)))], "too_large",
     "messages[1].content[0]: image is 52.0 megapixels (8000x6500), the limit is 25 megapixels"),
    ("svg", [_image(im.data_url(im.SVG, "image/svg+xml"))], "format", "not an image in a format this server reads"),
    ("svg as png", [_image(im.data_url(im.SVG))], "format", "not an image in a format this server reads"),
    ("pdf", [_image(im.data_url(im.PDF, ""))], "format", "not an image in a format this server reads"),
    ("pdf typed", [_image(im.data_url(im.PDF, "application/pdf"))], "format", "of media type 'application/pdf'"),
    ("url off", [{"type": "text", "text": "x"}, _image("https://example.com/a.png")], "url_off",
     "messages[1].content[1]: image URLs are not fetched by this router"),
    ("video", [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}], "video",
     "messages[1].content[0]: video input is not supported yet"),
    ("too many", [_image(im.data_url(OK))] * 4, "too_many",
     "messages[1].content[3]: the request has 4 images, the limit is 3"),
    ("aspect", [_image(im.data_url(im.encoded(600, 2)))], "aspect", "aspect ratio 300:1 is beyond 200:1"),
    ("empty data", [_image("data:image/png;base64,")], "corrupt", "messages[1].content[0]: the image is empty"),
    ("no comma", [_image("data:image/png;base64")], "corrupt", "messages[1].content[0]: a data: URL needs a ','"),
    ("ftp", [_image("ftp://x/a.png")], "url", "messages[1].content[0]: an image URL must be a data: URL"),
    ("url not a string", [{"type": "image_url", "image_url": {"url": 5}}], None, "messages[1].content[0]: an image"),
    ("no url", [{"type": "image_url"}], None, "messages[1].content[0]: an image part needs image_url.url"),
    ("stray placeholder", [{"type": "text", "text": "<|image_pad|>"}, _image(im.data_url(OK))], "count",
     "the prompt holds 2 <|image_pad|> placeholder(s) for 1 image(s)"),
]  # fmt: skip


@pytest.mark.parametrize("name,parts,reason,words", BAD, ids=[b[0] for b in BAD])
def test_bad_images_get_a_400_naming_the_part(vl, name, parts, reason, words):
    r, fake, port = vl
    before, counted = len(fake.requests), _refused(r, reason)
    t0 = time.monotonic()
    status, out = post(r.http_port, _chat(parts), "/v1/chat/completions")
    assert status == 400 and words in out["error"]["message"], (status, out)
    assert out["error"]["param"] == words.split(":")[0] if words.startswith("messages") else True
    assert time.monotonic() - t0 < 5
    assert len(fake.requests) == before  # nothing reached the node
    assert reason is None or _refused(r, reason) == counted + 1  # None: a malformed part, not an image
    status, out = post(
        r.http_port, _chat([{"type": "text", "text": "hi"}, _image(im.data_url(OK))]), "/v1/chat/completions"
    )
    assert status == 200 and out["choices"][0]["finish_reason"] == "length", out  # the router serves on


def test_responses_input_image(vl):
    r, fake, port = vl
    content = [{"type": "input_text", "text": "what is this"}, {"type": "input_image", "image_url": im.data_url(OK)}]
    body = {"model": "m", "input": [{"role": "user", "content": content}], "max_output_tokens": 2}
    before = len(fake.requests)
    status, out = post(r.http_port, json.dumps(body).encode(), "/v1/responses")
    assert status == 200 and out["status"] == "incomplete", out
    assert [tuple(i.grid_thw) for i in fake.requests[before].images] == [(1, 4, 6)]  # 40 x 30, scaled up to min_pixels
    content[1] = {"type": "input_image", "image_url": im.data_url(b"nope")}
    status, out = post(r.http_port, json.dumps(body).encode(), "/v1/responses")
    assert status == 400 and out["error"]["message"].startswith("input[0].content[1]: not an image"), out


def test_a_model_with_no_vision_tower_refuses_images(ckpt):
    r, fake, port, stop = _router(str(ckpt))
    try:
        status, out = post(r.http_port, _chat([_image(im.data_url(OK))]), "/v1/chat/completions")
        assert status == 400 and out["error"]["message"] == "messages[1].content[0]: this model does not take images"
        assert _refused(r, "no_vision") == 1 and not fake.requests
        status, out = post(r.http_port, _chat([{"type": "text", "text": "hi"}]), "/v1/chat/completions")
        assert status == 200, out
    finally:
        stop()


def test_urls_are_fetched_within_limits(fetching):
    r, fake, srv = fetching
    before = len(fake.requests)
    status, out = post(r.http_port, _chat([_image(srv.url + "/img.png")]), "/v1/chat/completions")
    assert status == 200, out
    assert fake.requests[before].images[0].data == srv.image
    status, out = post(r.http_port, _chat([_image(srv.url + "/hops/2")]), "/v1/chat/completions")
    assert status == 200, out  # two redirects: the limit
    for path, words in [
        ("/big", "body is 300,000 bytes, the limit is 200,000"),
        ("/big-chunked", "body is over the limit of 200,000 bytes"),
        ("/slow", "took longer than 1.5 s"),
        ("/hang", "took longer than 1.5 s"),
        ("/loop", "redirects in a loop"),
        ("/hops/3", "redirects more than 2 times"),
        ("/missing", "HTTP 404"),
    ]:
        t0 = time.monotonic()
        status, out = post(r.http_port, _chat([_image(srv.url + path)]), "/v1/chat/completions")
        took = time.monotonic() - t0
        assert status == 400 and words in out["error"]["message"], (path, out)
        assert out["error"]["message"].startswith("messages[1].content[0]: ")
        assert took < 8, (path, took)  # 1.5 s and the loaded box's slack (a hang would be minutes)
    assert len(fake.requests) == before + 2
    assert _refused(r, "url") == 7
    img = _image(srv.url + "/img.png")
    status, out = post(r.http_port, _chat([img, img, img]), "/v1/chat/completions")
    assert status == 400 and out["error"]["message"] == (
        "messages[1].content[2]: the request's images total more than 300,000 bytes (--max-body-bytes)"
    )
    assert threading.active_count() < 200


def test_cache_aware_names_cover_the_pixels():
    """The router names a prompt's pages as the nodes do, over the hash view: pages covering two
    different images of the same size differ, the same image again names the same pages, and the
    pages before the image are the text's."""
    from router.prefix import PrefixQuery

    pad, bs = 900, 4
    ids = [1, 2, 3, 4, 5, 6] + [pad] * 8 + [7, 8, 9]
    a, b = (pb.ImageInput(pixel_hash=hashlib.sha256(x).digest(), offset=6, grid_thw=[1, 4, 8]) for x in (b"a", b"b"))
    qa, qb, qa2, text = PrefixQuery(ids, [a]), PrefixQuery(ids, [b]), PrefixQuery(list(ids), [a]), PrefixQuery(ids)
    assert qa.pages(bs) == qa2.pages(bs) and qa.key(bs, 17) == qa2.key(bs, 17)
    assert qa.pages(bs)[0] == qb.pages(bs)[0] == text.pages(bs)[0]  # tokens 0-3: text only
    assert all(x != y for x, y in zip(qa.pages(bs)[1:], qb.pages(bs)[1:], strict=True))
    assert qa.key(bs, 17) != qb.key(bs, 17) and text.pages(bs)[1] not in (qa.pages(bs)[1], qb.pages(bs)[1])


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/a.png", "http://169.254.169.254/latest", "https://10.1.2.3/x",
                                 "http://[::1]/a", "http://[::ffff:127.0.0.1]/a", "http://localhost/a.png"])  # fmt: skip
def test_non_public_hosts_are_not_fetched_by_default(url):
    from router.images.config import ImageArgs
    from router.images.decode import ImageRefused
    from router.images.fetch import check_host, fetch_url

    args = ImageArgs(allow_image_urls=True)
    with pytest.raises(ImageRefused, match="non-public address .*--allow-private-image-urls"):
        fetch_url(url, args)
    check_host("http://8.8.8.8/a.png", args)  # a public address passes (a literal: no lookup)
    check_host(url, ImageArgs(allow_image_urls=True, allow_private_image_urls=True))


@pytest.mark.parametrize("url", ["http://user:secret@8.8.8.8/a.png", "https://token@8.8.8.8/a.png"])
def test_urls_with_credentials_are_refused_saying_so(url):
    """urllib reads `user:secret@host` as a host with a port; the refusal names the credentials."""
    from router.images.config import ImageArgs
    from router.images.decode import ImageRefused
    from router.images.fetch import fetch_url

    with pytest.raises(ImageRefused, match=r"credentials \(user:password@host\) are not fetched"):
        fetch_url(url, ImageArgs(allow_image_urls=True, allow_private_image_urls=True))

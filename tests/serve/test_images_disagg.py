"""Images through `pdserve up` with one prefill and one decode node at TP (1, 1), (2, 1) and
(1, 2), over the SDK: float32 greedy tokens equal transformers' `generate` on the same processed
inputs for one image, two of different sizes, an image in an earlier turn and text only, each
prefilled on P (which alone sees the pixels) and decoded on D from the transferred state and
rope_delta; the same image again is a prefix-cache hit on P with the same answer; the decode
node's memory comes back."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import vl_ckpt as vc
from tests.helpers.serve_harness import Up, creds, decode_stats, flags, log_url, node_info, scrape, wait_for

NEW = 8
CASES = ("one_image", "two_sizes", "earlier_turn", "text_only")


@pytest.fixture(scope="module")
def vl_refs(tmp_path_factory):
    path = vc.make(tmp_path_factory.mktemp("vl") / "ckpt", vc.SPEC_VL["qwen3_5"])
    out = {}
    for name in CASES:
        ids, imgs = vc.case(path, name)
        out[name] = (vc.chat_text(path, vc.CASES[name][0]), vc.case_images(name), vc.hf_greedy(path, ids, imgs, NEW))
    ids, imgs = vc.case(path, "one_image", seed=7)  # another image of the same size, the same text
    other = (out["one_image"][0], vc.case_images("one_image", seed=7), vc.hf_greedy(path, ids, imgs, NEW))
    return path, out, other


def _generate(c, text, images):
    return c.generate(prompt=text, images=images, max_tokens=NEW, temperature=0.0, ignore_eos=True)


# (2, 1) in the slow tier: a TP 2 prefill's replicated encoder is tested in the engine
# (tests/engine/test_vision_engine.py); (1, 2) stays, two receiving ranks taking rope_delta
# p1d2 (the decode pool resharding the vision rows) runs in the suite; p1d1 and p2d1 in the slow tier
TPS = [pytest.param((1, 1), marks=pytest.mark.slow), pytest.param((2, 1), marks=pytest.mark.slow), (1, 2)]


@pytest.mark.parametrize("tp", TPS, ids=lambda t: f"p{t[0]}d{t[1]}")
def test_images_disaggregated_match_transformers(vl_refs, tp):
    from client import Client

    path, cases, other = vl_refs
    a, b = tp
    opts = flags(
        dtype="float32", prefill=1, decode=1, prefill_tp=a, decode_tp=b, local_prefill_threshold=0, metrics_port=0
    )
    up = Up("--model", path, *opts, "--prefix-snapshot-interval", "16")
    try:
        d = node_info(up.address, "decode-0")
        initial = decode_stats(d.address).capacity
        with Client(up.address, timeout=180) as c:
            c.wait_ready(timeout=90)
            with ThreadPoolExecutor(len(cases)) as ex:
                outs = list(ex.map(lambda v: _generate(c, v[0], v[1]), cases.values()))
            for name, r, (_, _, want) in zip(cases, outs, cases.values()):
                assert r.token_ids == want, f"tp {a} -> {b}: {name}"
                assert r.prefill_node == "prefill-0" and r.transfer_bytes > 0, name
            if tp == (1, 1):
                # another image of the same size with the same text: its own answer, on both nodes
                assert other[2] != cases["one_image"][2]
                assert _generate(c, other[0], other[1]).token_ids == other[2]
                # the same image again: a prefix-cache hit on P (and D's cached pages), the same answer
                text, images, want = cases["one_image"]
                again = _generate(c, text, images)
                assert again.token_ids == want and again.cached_tokens > 16
                m = scrape(log_url(up, r"prefill node prefill-0 metrics at (http://\S+/metrics)"))
                assert m[("pdserve_prefill_images_total", ())] == 5  # the repeat's image is not encoded again
                assert m[("pdserve_prefill_encoder_seconds_total", ())] > 0
                md = scrape(log_url(up, r"decode node decode-0 metrics at (http://\S+/metrics)"))
                assert md[("pdserve_decode_prefix_hit_tokens_total", ())] > 16
                _bad_images_at_the_node(path, d.address)
        wait_for(lambda: decode_stats(d.address).capacity == initial, 30, "the decode node's memory back")
    except BaseException:
        print(up.output()[-6000:])
        raise
    finally:
        rc = up.stop()
    assert rc == 0, up.output()


def _bad_images_at_the_node(path: str, address: str) -> None:
    """A node called directly (not through the router) refuses bad images with INVALID_ARGUMENT
    naming the image, and serves on."""
    import dataclasses

    import grpc

    from proto import pb, rpc
    from serving.security import channel

    ids, (img,) = vc.case(path, "one_image")
    sp = pb.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    def call(i: vc.ImageInput | None, offset: int | None = None) -> grpc.RpcError | None:
        imgs = (
            []
            if i is None
            else [pb.ImageInput(data=i.data, pixel_hash=i.pixel_hash, offset=i.offset, grid_thw=i.grid_thw)]
        )
        if offset is not None:
            imgs[0].offset = offset
        try:
            list(
                rpc.DecodeNodeStub(ch).Generate(
                    pb.DecodeRequest(prompt_token_ids=ids, sampling=sp, images=imgs), timeout=60
                )
            )
        except grpc.RpcError as e:
            return e
        return None

    with channel(address, creds()) as ch:
        for bad, words in (
            (dataclasses.replace(img, data=b"junk"), "image 0: cannot decode its bytes"),
            (dataclasses.replace(img, pixel_hash=bytes(32)), "image 0: pixel_hash is not the SHA-256"),
            (dataclasses.replace(img, pixel_hash=b"x"), "images[0]: pixel_hash must be 32 bytes"),
            (None, "<|image_pad|> tokens but its 0 image(s)"),
        ):
            err = call(bad)
            assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, (words, err)
            assert words in str(err.details()), (words, err.details())
        err = call(img, offset=img.offset + 1)
        assert err is not None and "no run of" in str(err.details())
        assert call(img) is None  # and it serves on

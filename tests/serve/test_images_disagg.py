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
from tests.helpers.serve_harness import Up, decode_stats, flags, log_url, node_info, scrape, wait_for

NEW = 8
CASES = ("one_image", "two_sizes", "earlier_turn", "text_only")


@pytest.fixture(scope="module")
def vl_refs(tmp_path_factory):
    path = vc.make(tmp_path_factory.mktemp("vl") / "ckpt", vc.SPEC_VL["qwen3_5"])
    out = {}
    for name in CASES:
        ids, imgs = vc.case(path, name)
        out[name] = (vc.chat_text(path, vc.CASES[name][0]), vc.case_images(name), vc.hf_greedy(path, ids, imgs, NEW))
    return path, out


def _generate(c, text, images):
    return c.generate(prompt=text, images=images, max_tokens=NEW, temperature=0.0, ignore_eos=True)


# (2, 1) in the slow tier: a TP 2 prefill's replicated encoder is tested in the engine
# (tests/engine/test_vision_engine.py); (1, 2) stays, two receiving ranks taking rope_delta
TPS = [(1, 1), pytest.param((2, 1), marks=pytest.mark.slow), (1, 2)]


@pytest.mark.parametrize("tp", TPS, ids=lambda t: f"p{t[0]}d{t[1]}")
def test_images_disaggregated_match_transformers(vl_refs, tp):
    from client import Client

    path, cases = vl_refs
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
            if tp == (1, 1):  # the same image again: a prefix-cache hit on P, the same answer
                text, images, want = cases["one_image"]
                again = _generate(c, text, images)
                assert again.token_ids == want and again.cached_tokens > 16
                m = scrape(log_url(up, r"prefill node prefill-0 metrics at (http://\S+/metrics)"))
                assert m[("pdserve_prefill_images_total", ())] == 4  # the repeat's image is not encoded again
                assert m[("pdserve_prefill_encoder_seconds_total", ())] > 0
        wait_for(lambda: decode_stats(d.address).capacity == initial, 30, "the decode node's memory back")
    except BaseException:
        print(up.output()[-6000:])
        raise
    finally:
        rc = up.stop()
    assert rc == 0, up.output()

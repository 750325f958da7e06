"""The encode pool through `pdserve up --encode 1` (real processes, gRPC, NIXL on loopback):
float32 greedy tokens equal transformers' `generate` (and so the same requests without the pool,
tests/serve/test_images_disagg.py) for one image and two of different sizes; the encoder ran on
the encode node, never on the prefill node, which took the pushed outputs into its encoder cache;
an encode node killed as requests arrive leaves them exact (the prefill node encodes), and one
that stops answering is given up once marked dead, not after the whole Encode timeout; bad
images are still refused at the router; the pool works beside a UCXX data plane."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import grpc
import pytest

from tests.helpers import vl_ckpt as vc
from tests.helpers.serve_harness import Up, flags, log_url, node_pid, nodes, scrape, wait_for

NEW = 8


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    path = vc.make(tmp_path_factory.mktemp("vl") / "ckpt", vc.SPEC_VL["qwen3_5"])
    out = {}
    for name, seed in (("one_image", 0), ("two_sizes", 0), ("one_image", 7), ("one_image", 8), ("two_sizes", 9)):
        ids, imgs = vc.case(path, name, seed=seed)
        text = vc.chat_text(path, vc.CASES[name][0])
        out[(name, seed)] = (text, vc.case_images(name, seed), vc.hf_greedy(path, ids, imgs, NEW))
    return path, out


@contextmanager
def _cluster(path, *extra, **options):
    """`pdserve up` with an encode pool and a client to it; its log printed when the test fails."""
    from client import Client

    up = Up("--model", path, *flags(dtype="float32", **options), *extra)
    try:
        with Client(up.address, timeout=180) as c:
            c.wait_ready(timeout=90)
            yield up, c
            assert "Traceback" not in up.output()
    except BaseException:
        print(up.output()[-8000:])
        raise
    finally:
        up.stop()


def _generate(c, text, images):
    return c.generate(prompt=text, images=images, max_tokens=NEW, temperature=0.0, ignore_eos=True)


def _metric(up: Up, node: str, name: str, labels: tuple = ()) -> float:
    kind = node.split("-")[0]
    m = scrape(log_url(up, rf"{kind} node {node} metrics at (http://\S+/metrics)"))
    return m.get((name, labels), 0.0)


def test_encode_pool_exact_and_falls_back(refs):
    from client import PdserveError

    path, cases = refs
    pool = dict(prefill=1, decode=1, encode=1, local_prefill_threshold=0, metrics_port=0)
    with _cluster(path, **pool) as (up, c):
        router_metrics = log_url(up, r"router metrics at (http://\S+/metrics)")
        for key in (("one_image", 0), ("two_sizes", 0)):
            text, images, want = cases[key]
            r = _generate(c, text, images)
            assert r.token_ids == want, key
            assert r.prefill_node == "prefill-0" and r.transfer_bytes > 0, key
        # the encoder ran on the encode node only; the prefill node took three pushed outputs
        assert _metric(up, "encode-0", "pdserve_encode_images_total") == 3
        assert _metric(up, "prefill-0", "pdserve_prefill_images_received_total") == 3
        assert _metric(up, "prefill-0", "pdserve_prefill_images_total") == 0
        assert _metric(up, "prefill-0", "pdserve_prefill_encoder_cache_hits_total") >= 3
        m = scrape(router_metrics)
        assert m[("pdserve_router_encode_images_total", (("where", "encode_pool"),))] == 3
        assert up.find(r"(image \w+ encoded on encode-0)")

        # bad images: still 400 at the router, nothing reaches a node
        text, images, _ = cases[("one_image", 0)]
        with pytest.raises(PdserveError) as bad:
            _generate(c, text, [b"junk" * 10])
        assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT and "images[0]" in bad.value.message

        _bad_calls_at_the_nodes(up)
        _paused_encode_node(up, c, path)

        # the encode node dies as requests arrive, before the router has noticed (killed just
        # before them: killed after, it could have encoded every image first): every answer
        # stays exact, each new image encoded once, on the prefill node
        later = [("one_image", 7), ("one_image", 8), ("two_sizes", 9)]
        os.kill(node_pid(up, "encode-0"), signal.SIGKILL)
        with ThreadPoolExecutor(len(later)) as ex:
            futs = [ex.submit(_generate, c, cases[k][0], cases[k][1]) for k in later]
            outs = [f.result() for f in futs]
        for k, r in zip(later, outs):
            assert r.token_ids == cases[k][2], k
        encoded_here = _metric(up, "prefill-0", "pdserve_prefill_images_total")
        received = _metric(up, "prefill-0", "pdserve_prefill_images_received_total")
        assert (encoded_here, received) == (5, 3)  # 4 here, and the one the paused node left
        # with the pool gone, the next image request is encoded on the prefill node at once
        gone = lambda: not any(n.alive for n in nodes(up.address) if n.node.node_id == "encode-0")  # noqa: E731
        wait_for(gone, 20, "encode-0 marked dead")
        text, images, want = cases[("one_image", 0)]
        assert _generate(c, text, [vc.png(120, 90, seed=21)]).finish_reason == "length"
        m = scrape(router_metrics)
        assert m[("pdserve_router_encode_images_total", (("where", "prefill_no_pool"),))] >= 1


def _paused_encode_node(up: Up, c, path: str) -> None:
    """The encode node stops answering (SIGSTOP: connections accepted, nothing answered, no
    heartbeats) while a request's Encode call waits on it: once the router marks it dead (3 s
    without heartbeats) the call is given up and the prefill node encodes the image, exact,
    rather than after the whole --encode-timeout (30 s). Resumed, it serves again."""
    import time

    assert up.address is not None
    pid = node_pid(up, "encode-0")
    image = vc.png(96, 72, seed=31)
    text = vc.chat_text(path, vc.CASES["one_image"][0])
    want = vc.hf_greedy(path, *vc.chat(path, vc.CASES["one_image"][0], [image]), NEW)
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        r = _generate(c, text, [image])
        took = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
    assert r.token_ids == want and took < 15, took
    assert up.find(r"(encode-0 was marked dead during its Encode call)")
    back = lambda: any(n.alive for n in nodes(up.address) if n.node.node_id == "encode-0")  # noqa: E731
    wait_for(back, 20, "encode-0 back")


def _bad_calls_at_the_nodes(up: Up) -> None:
    """Malformed encode-pool calls made straight to the nodes: INVALID_ARGUMENT with a message."""
    from proto import pb, rpc
    from serving.security import channel
    from tests.helpers.serve_harness import creds, node_info

    assert up.address is not None
    enc, pre = node_info(up.address, "encode-0"), node_info(up.address, "prefill-0")
    with channel(enc.address, creds()) as ch:
        with pytest.raises(grpc.RpcError) as e:
            rpc.EncodeNodeStub(ch).Encode(pb.EncodeRequest(request_id="x", landing=b"junk"), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "LandingTarget" in str(e.value.details())
    with channel(pre.address, creds()) as ch:
        bad = pb.ImageInput(pixel_hash=b"short", grid_thw=[1, 4, 4])
        with pytest.raises(grpc.RpcError) as e:
            rpc.PrefillNodeStub(ch).ReserveEncoded(pb.ReserveEncodedRequest(request_id="x", images=[bad]), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "images[0]" in str(e.value.details())


@pytest.mark.slow  # a TP 2 prefill node (two worker processes) beside an encode node: over 30 s here
def test_encode_pool_into_a_tp2_prefill(refs):
    """Every rank of a TP 2 prefill node takes the whole pushed output (replicated): exact tokens,
    and no rank ran the encoder."""

    path, cases = refs
    tp2 = dict(prefill=1, decode=1, encode=1, prefill_tp=2, local_prefill_threshold=0, metrics_port=0)
    with _cluster(path, **tp2) as (up, c):
        for key in (("one_image", 0), ("two_sizes", 0)):
            text, images, want = cases[key]
            assert _generate(c, text, images).token_ids == want, key
        assert _metric(up, "prefill-0", "pdserve_prefill_images_received_total") == 3
        assert _metric(up, "prefill-0", "pdserve_prefill_images_total") == 0


def test_encode_pool_beside_a_ucxx_data_plane(refs):
    """`--transfer-backend ucxx` moves pages and states over UCXX; encoder outputs still land over
    NIXL in the same processes: exact tokens, the images encoded on the encode node only."""

    path, cases = refs
    pool = dict(prefill=1, decode=1, encode=1, local_prefill_threshold=0, metrics_port=0)
    with _cluster(path, "--transfer-backend", "ucxx", **pool) as (up, c):
        text, images, want = cases[("one_image", 0)]
        r = _generate(c, text, images)
        assert r.token_ids == want and r.prefill_node == "prefill-0" and r.transfer_bytes > 0
        assert _metric(up, "prefill-0", "pdserve_prefill_images_received_total") == 1
        assert _metric(up, "prefill-0", "pdserve_prefill_images_total") == 0


def test_one_new_image_in_concurrent_requests_is_encoded_once(refs):
    """Requests that arrive together with the same new image share one encode: the later ones
    wait for the encode node's push the first asked for (the router keys what is in flight by
    prefill node and pixel hash) instead of finding its landing slot taken and leaving the image to
    the prefill node's own encoder (counted prefill_no_room). Every answer exact."""
    path, cases = refs
    text, images, want = cases[("one_image", 0)]
    pool = dict(prefill=1, decode=1, encode=1, local_prefill_threshold=0, metrics_port=0)
    with _cluster(path, **pool) as (up, c):
        n = 4
        with ThreadPoolExecutor(n) as ex:
            outs = list(ex.map(lambda _: _generate(c, text, images), range(n)))
        assert all(r.token_ids == want for r in outs)
        assert _metric(up, "encode-0", "pdserve_encode_images_total") == 1
        assert _metric(up, "prefill-0", "pdserve_prefill_images_total") == 0  # the prefill node encoded none
        m = scrape(log_url(up, r"router metrics at (http://\S+/metrics)"))
        where = {
            w: m.get(("pdserve_router_encode_images_total", (("where", w),)), 0)
            for w in ("encode_pool", "shared", "cached")
        }
        assert where["encode_pool"] == 1 and where["shared"] + where["cached"] == n - 1, where

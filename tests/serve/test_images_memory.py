"""Image requests on a decode node whose memory runs out, through `pdserve up` (every prompt
prefilled on the prefill node, so the decode node holds no pixels): the node gives up the memory
of some of them (it cannot recompute their prompts), and the router moves each, with the tokens
already sent and its images, to be computed again; every request then answers its whole length,
its tokens those of transformers' greedy `generate` (up to the first end-of-sequence token, which
`ignore_eos` passes and transformers' `min_new_tokens` masks). Before, each such request ended
early with finish reason "abort"."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import vl_ckpt as vl
from tests.helpers.serve_harness import Up, decode_stats, flags, node_info, wait_for

N = 80
REQUESTS = 6


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory):
    return vl.make(tmp_path_factory.mktemp("vl") / "ckpt", vl.SPEC_VL["qwen3_5"])


def _case(path: str, k: int) -> tuple[str, list[bytes], list[int]]:
    from engine.tokenizer import Tokenizer

    images = [vl.png(100 + 10 * k, 80, 40 + k)] + ([vl.png(60, 90, 60 + k)] if k % 2 else [])
    msgs = [vl.user(*([None] * len(images)), "Describe it.")]
    text = vl.chat_text(path, msgs)
    ids, inputs = vl.expand(path, Tokenizer(path).encode(text), images)
    return text, images, vl.hf_greedy(path, ids, inputs, N)


def test_image_requests_whose_memory_the_decode_node_gives_up_are_moved_and_exact(vl_model):
    from client import Client

    cases = [_case(vl_model, k) for k in range(REQUESTS)]
    opts = flags(
        dtype="float32",
        prefill=1,
        decode=1,
        local_prefill_threshold=0,
        kv_cache_memory="1MiB",  # about 290 tokens: two requests at once, not three
        max_num_seqs=REQUESTS,
        max_model_len=512,
        reasoning_parser="none",
        tool_call_parser="none",
    )
    up = Up("--model", vl_model, *opts)
    try:
        with Client(up.address, timeout=180) as c:
            c.wait_ready(timeout=90)

            def go(k: int):
                text, images, _ = cases[k]
                return c.generate(prompt=text, images=images, max_tokens=N, temperature=0.0, ignore_eos=True)

            with ThreadPoolExecutor(REQUESTS) as ex:
                outs = list(ex.map(go, range(REQUESTS)))
        for k, r in enumerate(outs):
            got = list(r.token_ids)
            assert r.finish_reason == "length" and len(got) == N, (k, r.finish_reason, len(got))
            end = got.index(0) if 0 in got else N  # the tiny checkpoint's end-of-sequence id is 0
            assert got[:end] == cases[k][2][:end], k
        assert up.find(r"failed after \d+ tokens \((decode-0\(memory@\d+\))\): moving it")
        assert up.address is not None
        d = node_info(up.address, "decode-0")
        free = lambda: (lambda c: (c.free_slots, c.running) == (c.total_slots, 0))(decode_stats(d.address).capacity)  # noqa: E731
        wait_for(free, 20, "the decode node's slots back")
        assert "Traceback" not in up.output()
    except BaseException:
        print(up.output()[-8000:])
        raise
    finally:
        up.stop()

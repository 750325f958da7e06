"""MTP speculative decoding through `pdserve up`: prefill and decode pools at different TP sizes
(both `--speculative-method mtp`, k = 1, 2, 3) give transformers' greedy tokens, with the
checkpoint's block fitted to the prompts' greedy continuations so that drafts after the
transfer are accepted and verified (tests/hybrid_ckpt.py `make_fitted_mtp`); the decode node reports its
drafts per position in Stats and as Prometheus counters; a method mismatch is refused at the
transfer handshake, naming both values."""

from __future__ import annotations

import dataclasses
import re
import urllib.request

import hybrid_ckpt as hc
import pytest
from serve_harness import Up, decode_stats, nodes, wait_for

NEW = 16


PROMPTS = hc.prompts(lens=(3, 40), seed=9)


@pytest.fixture(scope="module")
def ckpt_mtp(tmp_path_factory):
    spec = dataclasses.replace(hc.SPEC_MTP, tokenizer=True)
    return hc.make_fitted_mtp(tmp_path_factory.mktemp("serve-mtp") / "ckpt", spec, PROMPTS)


@pytest.fixture(scope="module")
def mtp_refs(ckpt_mtp):
    return PROMPTS, [hc.hf_greedy(ckpt_mtp, p, NEW) for p in PROMPTS]


def _scrape(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text)
            for s in f.samples}  # fmt: skip


@pytest.mark.parametrize("a,b,k", [(1, 2, 1), (1, 2, 2), (2, 1, 3)], ids=["tp1to2-k1", "tp1to2-k2", "tp2to1-k3"])
def test_mtp_greedy_matches_transformers_across_tp(ckpt_mtp, mtp_refs, a, b, k):
    from client import Client

    ps, want = mtp_refs
    up = Up("--model", ckpt_mtp, "--dtype", "float32", "--prefill", "1", "--decode", "1", "--prefill-tp", str(a),
            "--decode-tp", str(b), "--local-prefill-threshold", "0", "--speculative-method", "mtp",
            "--num-speculative-tokens", str(k), "--kv-cache-memory", "64MiB", "--max-num-seqs", "8",
            "--metrics-port", "0")  # fmt: skip
    try:
        d = next(n.node for n in nodes(up.address) if n.node.node_id == "decode-0")
        with Client(up.address, timeout=120) as c:
            c.wait_ready(timeout=60)
            for p, w in zip(ps, want):
                r = c.generate(prompt_token_ids=p, max_tokens=NEW, temperature=0.0, ignore_eos=True)
                assert r.token_ids == w, f"prompt of {len(p)} tokens, tp {a} -> {b}"
                assert r.prefill_node == "prefill-0" and r.transfer_bytes > 0
        spec = decode_stats(d.address).speculation
        assert spec.method == "mtp" and spec.num_tokens == k
        assert len(spec.drafts_per_position) == k and spec.accepted_per_position[0] > 0
        assert all(x <= y for x, y in zip(spec.accepted_per_position, spec.drafts_per_position))
        url = wait_for(lambda: next((m.group(1) for ln in up.lines
                                     if (m := re.search(r"decode node decode-0 metrics at (http://\S+/metrics)", ln))),
                                    None), 20, "the decode node's metrics address")  # fmt: skip
        got = _scrape(url)
        key = ("pdserve_decode_spec_position_drafts_total", (("position", "1"),))
        assert got[key] == spec.drafts_per_position[0]
    finally:
        rc = up.stop()
    assert rc == 0, up.output()


def test_handshake_refuses_another_speculative_method(ckpt_mtp):
    from engine.config import EngineArgs
    from transfer.errors import HandshakeError
    from transfer.handshake import check_digest
    from transfer.schema import model_digest

    mtp = model_digest(EngineArgs(ckpt_mtp, num_speculative_tokens=2, speculative_method="mtp").engine_config())
    ngram = model_digest(EngineArgs(ckpt_mtp, num_speculative_tokens=2).engine_config())
    with pytest.raises(HandshakeError) as e:
        check_digest(mtp, ngram)
    assert "speculative_method" in str(e.value) and "mtp" in str(e.value) and "ngram" in str(e.value)

"""MTP speculative decoding through `pdserve up`: prefill and decode pools at TP (1, 2) and (2, 1)
(both `--speculative-method mtp`; k = 1, 2, 3 per request with `num_speculative_tokens`) give transformers' greedy tokens, with the
checkpoint's block fitted to the prompts' greedy continuations so that drafts after the
transfer are accepted and verified (tests/helpers/hybrid_ckpt.py `make_fitted_mtp`); the decode node reports its
drafts per position in Stats and as Prometheus counters; a conversation's second turn resumes
past the first's reply with MTP on and still gives transformers' tokens; a stop string inside a
run of accepted drafts ends the text, token ids and usage at its token; a method mismatch is
refused at the transfer handshake, naming both values."""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request

import pytest

from tests.helpers import hybrid_ckpt as hc
from tests.helpers.serve_harness import Up, decode_stats, flags, log_url, nodes, wait_for

NEW = 16
K = 3  # the nodes' --num-speculative-tokens; requests cap it at 1 and 2


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
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _stops_cut_at_their_token(base: str, model: str, ckpt: str, prompt: list[int], want: list[int]) -> int:
    """A stop string that is token j's text, j inside a run of accepted drafts: the text ends
    before it and the output (token ids, usage) at token j, not at the end of the step's run.
    Returns the stop strings checked."""
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(ckpt)
    checked = 0
    for j in range(1, len(want)):
        piece, before = tok.decode([want[j]]), tok.decode(want[:j])
        if not (piece.isprintable() and piece.strip() == piece != "" and "\ufffd" not in piece) or tok.decode(
            want[: j + 1]
        ).find(piece) != len(before):
            continue  # not a clean piece, or its text first appears elsewhere
        body = {"model": model, "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True}
        st, got = _post(base + "/completions", {**body, "stop": [piece], "return_token_ids": True})
        c = got["choices"][0]
        assert st == 200 and (c["text"], c["finish_reason"], c["stop_reason"]) == (before, "stop", piece), got
        assert c["token_ids"] == want[: j + 1] and got["usage"]["completion_tokens"] == j + 1, (j, got)
        checked += 1
    return checked


@pytest.mark.parametrize("a,b", [(1, 2), pytest.param(2, 1, marks=pytest.mark.slow)], ids=["tp1to2", "tp2to1"])
def test_mtp_greedy_matches_transformers_across_tp(ckpt_mtp, mtp_refs, a, b):
    """Nodes at k = 3; each request caps its drafts (num_speculative_tokens 1, then 2, then the
    nodes' 3): every k gives transformers' tokens, and the decode node's drafts per position show
    the cap held on both pools (the prefill node's first drafts included). Above the nodes' k:
    INVALID_ARGUMENT over gRPC, 400 over HTTP."""
    import grpc

    from client import Client, PdserveError

    ps, want = mtp_refs
    up = Up(
        "--model",
        ckpt_mtp,
        *flags(
            dtype="float32",
            prefill=1,
            decode=1,
            prefill_tp=a,
            decode_tp=b,
            local_prefill_threshold=0,
            speculative_method="mtp",
            num_speculative_tokens=K,
            kv_cache_memory="64MiB",
            max_num_seqs=8,
            metrics_port=0,
            http_port=0,
        ),
    )
    try:
        d = next(n.node for n in nodes(up.address) if n.node.node_id == "decode-0")
        before = [0] * K
        with Client(up.address, timeout=120) as c:
            c.wait_ready(timeout=60)
            for k in (1, 2, None):
                for p, w in zip(ps, want):
                    r = c.generate(
                        prompt_token_ids=p, max_tokens=NEW, temperature=0.0, ignore_eos=True, num_speculative_tokens=k
                    )
                    assert r.token_ids == w, f"prompt of {len(p)} tokens, tp {a} -> {b}, k {k}"
                    assert r.prefill_node == "prefill-0" and r.transfer_bytes > 0
                spec = decode_stats(d.address).speculation
                drafts = list(spec.drafts_per_position)
                grew = [x - y for x, y in zip(drafts, before)]
                depth = k or K
                assert all(g > 0 for g in grew[:depth]) and not any(grew[depth:]), (k, grew)
                before = drafts
            # a conversation's second turn resumes past the first's reply (prefix caching stays on):
            # from the decode node's final state of it, every token but the last, its reply pages
            # (filled by runs of accepted drafts) cached under their own tokens
            turn2 = ps[1] + want[1] + hc.prompts(lens=(4,), seed=10)[0]
            r2 = c.generate(prompt_token_ids=turn2, max_tokens=NEW, temperature=0.0, ignore_eos=True)
            assert r2.token_ids == hc.hf_greedy(ckpt_mtp, turn2, NEW)
            assert r2.cached_tokens == len(ps[1]) + NEW - 1
            # a prompt the block was not fitted to: its drafts are rejected and the reply ends at
            # draft depth 0 (deferred MTP passes); its next turn resumes past it all the same,
            # greedy (transformers' tokens) and seeded with Qwen's sampling settings (the tokens
            # of the same turn under another cache_salt, which finds nothing cached)
            p3, msg = hc.prompts(lens=(24, 4), seed=11)
            qwen = dict(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5, seed=3)
            for i, kw in enumerate([dict(temperature=0.0), qwen]):
                r3 = c.generate(prompt_token_ids=p3, max_tokens=NEW, ignore_eos=True, **kw)
                turn = p3 + r3.token_ids + msg
                r4 = c.generate(prompt_token_ids=turn, max_tokens=NEW, ignore_eos=True, **kw)
                fresh = c.generate(prompt_token_ids=turn, max_tokens=NEW, ignore_eos=True, cache_salt=f"t{i}", **kw)
                assert (r4.cached_tokens, fresh.cached_tokens) == (len(p3) + NEW - 1, 0), kw
                assert r4.token_ids == fresh.token_ids, kw
                if not i:
                    assert r4.token_ids == hc.hf_greedy(ckpt_mtp, turn, NEW)
            with pytest.raises(PdserveError) as e:
                c.generate(prompt_token_ids=ps[0], max_tokens=4, num_speculative_tokens=K + 1)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "num_speculative_tokens" in str(e.value)
        assert spec.method == "mtp" and spec.num_tokens == K and spec.accepted_per_position[0] > 0
        assert all(x <= y for x, y in zip(spec.accepted_per_position, spec.drafts_per_position))
        base = log_url(up, r"OpenAI-compatible HTTP on (http://\S+/v1)")
        with urllib.request.urlopen(base + "/models", timeout=10) as r:
            model = json.loads(r.read())["data"][0]["id"]
        body = {"model": model, "prompt": ps[0], "max_tokens": 4, "temperature": 0}
        st, got = _post(base + "/completions", {**body, "num_speculative_tokens": K + 1})
        assert st == 400 and "num_speculative_tokens" in got["error"]["message"], got
        st, got = _post(base + "/completions", {**body, "num_speculative_tokens": 1})
        assert st == 200, got
        assert sum(_stops_cut_at_their_token(base, model, ckpt_mtp, p, w) for p, w in zip(ps, want)) >= 3
        url = up.find(r"decode node decode-0 metrics at (http://\S+/metrics)", 20)
        key = ("pdserve_decode_spec_position_drafts_total", (("position", "1"),))
        # a stop string cancels its request upstream: the decode node may still be ending its
        # last step when the client has the answer, so the two reads agree once it is idle
        wait_for(
            lambda: _scrape(url)[key] == decode_stats(d.address).speculation.drafts_per_position[0],
            10,
            "the metrics page to agree with Stats",
        )
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

"""Sampling: seeds repeat, temperature departs from greedy, stop conditions and finish reasons."""

from __future__ import annotations

import pytest

from engine import SamplingParams

P = [[5, 17, 300, 42, 9, 77, 1000, 3]]


def _gen(llm, **kw):
    return llm.generate(prompt_token_ids=P, sampling_params=SamplingParams(**kw))[0]


def test_seeded_sample_repeats_exactly(llm_hv2):
    a = _gen(llm_hv2, max_tokens=32, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    b = _gen(llm_hv2, max_tokens=32, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    assert a.output_token_ids == b.output_token_ids


def test_seed_independent_of_batch_company(llm_hv2):
    sp = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    alone = llm_hv2.generate(prompt_token_ids=P, sampling_params=sp)[0]
    other = SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)
    mixed = llm_hv2.generate(prompt_token_ids=[[1, 2, 3], P[0], [9] * 40], sampling_params=[other, sp, other])
    assert mixed[1].output_token_ids == alone.output_token_ids


def test_seeded_sample_with_logit_bias(llm_hv2):
    """Same seed, same tokens with a bias too, in any batch; +100 on two tokens keeps every
    sample to those two, and -100 keeps a token out."""
    kw = dict(max_tokens=24, temperature=1.0, seed=99, ignore_eos=True)
    plain = _gen(llm_hv2, **kw).output_token_ids
    bias = {11: 100.0, 12: 100.0}
    a = _gen(llm_hv2, logit_bias=bias, **kw).output_token_ids
    assert a == _gen(llm_hv2, logit_bias=bias, **kw).output_token_ids
    assert set(a) == {11, 12}
    other = SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)
    mixed = llm_hv2.generate(
        prompt_token_ids=[[1, 2, 3], P[0]], sampling_params=[other, SamplingParams(logit_bias=bias, **kw)]
    )
    assert mixed[1].output_token_ids == a
    ban = {t: -100.0 for t in plain[:4]}
    b = _gen(llm_hv2, logit_bias=ban, **kw).output_token_ids
    assert b == _gen(llm_hv2, logit_bias=ban, **kw).output_token_ids and not set(b) & set(ban)


def test_temperature_differs_from_greedy(llm_hv2):
    greedy = _gen(llm_hv2, max_tokens=32, temperature=0.0, ignore_eos=True)
    sampled = _gen(llm_hv2, max_tokens=32, temperature=1.5, seed=3, ignore_eos=True)
    other_seed = _gen(llm_hv2, max_tokens=32, temperature=1.5, seed=4, ignore_eos=True)
    assert sampled.output_token_ids != greedy.output_token_ids
    assert sampled.output_token_ids != other_seed.output_token_ids


def test_top_k_1_is_greedy(llm_hv2):
    greedy = _gen(llm_hv2, max_tokens=16, temperature=0.0, ignore_eos=True)
    topk1 = _gen(llm_hv2, max_tokens=16, temperature=2.0, top_k=1, seed=5, ignore_eos=True)
    assert topk1.output_token_ids == greedy.output_token_ids


def test_top_k_restricts_to_k_most_likely(llm_hv2):
    import torch

    logits = llm_hv2.compute_logits(P)[0]
    top3 = set(torch.topk(logits, 3).indices.tolist())
    for seed in range(12):
        o = _gen(llm_hv2, max_tokens=1, temperature=5.0, top_k=3, seed=seed, ignore_eos=True)
        assert o.output_token_ids[0] in top3


def test_stop_token_and_max_tokens(llm_hv2):
    greedy = _gen(llm_hv2, max_tokens=20, temperature=0.0, ignore_eos=True)
    stop_at = greedy.output_token_ids[5]
    first = greedy.output_token_ids.index(stop_at)
    o = _gen(llm_hv2, max_tokens=20, temperature=0.0, stop_token_ids=[stop_at], ignore_eos=True)
    assert o.output_token_ids == greedy.output_token_ids[: first + 1]
    assert o.finish_reason == "stop"
    assert greedy.finish_reason == "length" and len(greedy.output_token_ids) == 20


def test_eos_stops_unless_ignored(ckpt_hv2):
    from engine import LLM
    from engine.config import ModelConfig

    greedy_tokens = None
    with LLM(ckpt_hv2, dtype="float32") as llm:
        greedy_tokens = _gen(llm, max_tokens=12, temperature=0.0, ignore_eos=True).output_token_ids
    # Treat the 4th greedy token as EOS by rewriting the checkpoint's config.
    import json
    import shutil
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        dst = Path(d) / "ck"
        shutil.copytree(ckpt_hv2, dst)
        cfg = json.loads((dst / "config.json").read_text())
        cfg["eos_token_id"] = greedy_tokens[3]
        (dst / "config.json").write_text(json.dumps(cfg))
        assert ModelConfig.from_dir(dst).eos_token_ids == (greedy_tokens[3],)
        with LLM(str(dst), dtype="float32") as llm:
            o = _gen(llm, max_tokens=12, temperature=0.0)
            kept = _gen(llm, max_tokens=12, temperature=0.0, ignore_eos=True)
    first = greedy_tokens.index(greedy_tokens[3])
    assert o.output_token_ids == greedy_tokens[: first + 1] and o.finish_reason == "stop"
    assert kept.output_token_ids == greedy_tokens


def test_abort_frees_everything(llm_hv2):
    e = llm_hv2.engine
    free_blocks, free_slots = e.blocks.num_free, e.slots.num_free
    sp = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    rid = e.add_request(list(range(1, 90)), sp)
    keep = e.add_request([4, 5, 6], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    e.step()
    e.step()
    assert e.blocks.num_free < free_blocks
    out = e.abort(rid)
    assert out.finished and out.finish_reason == "abort"
    done = {}
    while e.has_unfinished():
        for o in e.step():
            if o.finished:
                done[o.request_id] = o
    assert rid not in done and done[keep].finish_reason == "length"
    assert (e.blocks.num_free, e.slots.num_free) == (free_blocks, free_slots)


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-5), "top_k"),
        (dict(seed=-1), "seed"),
        (dict(stop_token_ids=[-2]), "stop_token_ids"),
        (dict(beam_width=4), "unknown sampling option"),
    ],
    ids=["max_tokens_0", "max_tokens_neg", "temperature", "top_p", "top_k", "seed", "stop_ids", "unknown_option"],
)
def test_bad_sampling_params(kw, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kw)

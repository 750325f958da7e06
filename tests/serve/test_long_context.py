"""Long prompts through `pdserve up` on a YaRN checkpoint (rope_parameters yarn, factor 4 over an
original context of 512: max_model_len 2048), one prefill and one decode node sized apart (a
pools file: the prefill node's cache holds fewer tokens than the decode node's, as a prefill node
at TP 1 beside a decode node at TP 2 does), small pages and a small step budget so each prompt
runs in several chunks:

- a prompt of 1,100 tokens, past the original context, goes through the transfer and gives
  transformers' greedy tokens; the same prompt again resumes at the last snapshot grid point
  (1,024) on the prefill node, and the prompt with a reply and a new message after it resumes at
  its end (only the suffix is computed);
- a prompt the prefill node's cache cannot hold but the decode node's can is computed on the
  decode node (it was sent to the prefill node, which refused it: a 400 telling the user to raise
  a cache that was big enough), with transformers' tokens, and its INFO line says so;
- prompts longer than max_model_len or than the decode node's cache are a 400 naming the limit;
- every page and state slot is free afterwards on both nodes.

transformers' reference is one teacher-forced forward over the longest conversation, whose
prefixes are the other prompts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests.helpers import hybrid_ckpt as hc
from tests.helpers.serve_harness import Up, decode_stats, flags, log_url, node_info, prefill_stats, wait_for

ORIGINAL, FACTOR, BLOCK = 512, 4, 16
CONTEXT = ORIGINAL * FACTOR
NEW = 6
# caches: the prefill node's 88 pages hold prompts of up to 1,407 tokens, the decode node's 124
# pages up to 1,983 (under max_model_len); measured on this checkpoint, asserted below
POOLS = "prefill:\n  count: 1\n  kv_cache_memory: 2.5MiB\n  prefix_snapshot_memory: 0.4\ndecode:\n  count: 1\n  kv_cache_memory: 2.3MiB\n"


@pytest.fixture(scope="module")
def yarn_ckpt(tmp_path_factory):
    spec = dataclasses.replace(hc.SPEC_HV2, layers=4, max_positions=ORIGINAL)
    path = Path(hc.make(tmp_path_factory.mktemp("longctx") / "ckpt", spec))
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"].update(rope_type="yarn", factor=float(FACTOR), original_max_position_embeddings=ORIGINAL)
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture(scope="module")
def long_up(yarn_ckpt, tmp_path_factory):
    pools = tmp_path_factory.mktemp("longctx-pools") / "pools.yaml"
    pools.write_text(POOLS)
    opts = flags(dtype="float32", block_size=BLOCK, max_num_seqs=2, max_num_batched_tokens=256)
    pooled = flags(local_prefill_threshold=0, local_resume_threshold=0)  # every prompt P can hold goes to P
    up = Up("--model", yarn_ckpt, "--config", str(pools), *opts, *pooled, "--http-port", "0")
    yield up
    rc = up.stop()
    assert rc == 0, up.output()


def test_long_prompts_served_as_transformers_within_each_nodes_cache(yarn_ckpt, long_up):
    import openai

    from client import Client

    d, p = node_info(long_up.address, "decode-0"), node_info(long_up.address, "prefill-0")
    assert d.max_model_len == CONTEXT
    held = {
        n: s.capacity.total_blocks * BLOCK - 1
        for n, s in (("p", prefill_stats(p.address)), ("d", decode_stats(d.address)))
    }
    assert held["d"] == 124 * BLOCK - 1  # 2.3 MiB of float32 pages: what the refusals below name
    a = hc.prompts(vocab=1024, lens=(1100,), seed=21)[0]

    def gen(c, ids):
        r = c.generate(prompt_token_ids=ids, max_tokens=NEW, temperature=0.0, ignore_eos=True, admission_timeout_s=0)
        return r.token_ids, r.prefill_node, r.cached_tokens

    with Client(long_up.address, timeout=120) as c:
        c.wait_ready(timeout=60)
        out_a, via_a, _ = gen(c, a)
        again, _, cached_again = gen(c, a)
        b = a + out_a + hc.prompts(lens=(40,), seed=22)[0]  # the next turn: reply and a new message
        out_b, via_b, cached_b = gen(c, b)
        last = b + out_b + hc.prompts(lens=(600,), seed=23)[0]  # 1,752 tokens: the decode node's alone
        out_last, via_last, _ = gen(c, last)
    # the prefill node's cache (less its transfer staging) holds the first turns, not the last
    assert len(b) + NEW <= held["p"] < len(last) <= held["d"]
    assert (via_a, via_b, via_last) == ("prefill-0", "prefill-0", "")
    assert again == out_a and cached_again == 1024  # the grid point below the prompt's last token
    assert cached_b == len(a)  # the first prompt's end: only the reply and the new message computed
    # one forward over the last conversation: the earlier prompts and their outputs are its prefixes
    assert b[: len(a) + NEW] == a + out_a and last[: len(b) + NEW] == b + out_b
    assert _greedy_misses(yarn_ckpt, last + out_last, [(a, out_a), (b, out_b), (last, out_last)]) == []
    long_up.find(rf"request \S+: prompt {len(last)}, decode decode-0, prefill (local), .*ttft", 10)

    url = log_url(long_up, r"OpenAI-compatible HTTP on (http://\S+/v1)")
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60) as oai:
        model = oai.models.list().data[0]
        assert model.max_model_len == CONTEXT  # type: ignore[attr-defined]
        for n, says in (
            (CONTEXT, f"max_model_len is {CONTEXT}"),
            (1990, "needs 125 KV blocks; the largest decode node holds 124"),
        ):
            with pytest.raises(openai.BadRequestError) as e:
                oai.completions.create(model=model.id, prompt=[7] * n, max_tokens=2)
            assert f"prompt of {n} tokens" in str(e.value) and says in str(e.value)

    def free(s):
        return s.capacity.free_blocks == s.capacity.total_blocks and s.capacity.free_slots == s.capacity.total_slots

    wait_for(lambda: free(decode_stats(d.address)) and free(prefill_stats(p.address)), 30, "every page and slot free")


def _greedy_misses(path: str, seq: list[int], asked: list[tuple[list[int], list[int]]]) -> list[tuple[int, int]]:
    """(prompt length, output index) where an output token is not transformers' greedy choice
    (nor within 1e-4 of its max logit), teacher-forced: one forward over `seq`, which holds each
    prompt followed by its output."""
    import torch

    with torch.inference_mode():
        logits = hc._hf_model(path)(torch.tensor([seq[:-1]])).logits[0].float()
    misses = []
    for prompt, out in asked:
        rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(out)]
        short = rows.max(-1).values - rows.gather(1, torch.tensor(out)[:, None])[:, 0]
        misses += [(len(prompt), k) for k in (short > 1e-4).nonzero().flatten().tolist()]
    return misses

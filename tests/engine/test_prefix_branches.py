"""Snapshots where conversations branch (docs/prefix-caching.md): before each ChatML message
(`<|im_end|>`, newline, `<|im_start|>`) and where a prompt departs from cached pages mid-grid, so
the next prompt sharing a system prompt or a branch resumes whole; greedy float32 tokens equal
transformers' and nothing is held afterwards."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.tiny_model import TinyModelSpec
from engine.tokenizer import Tokenizer
from tests.helpers import hybrid_ckpt as hc

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _rand(n: int, seed: int, low: int = 0) -> list[int]:
    return torch.randint(low, 600, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _all_back(llm: LLM) -> None:
    e = llm.engine
    assert (e.blocks.num_free, e.slots.num_free) == (llm.capacity().num_blocks, llm.capacity().num_state_slots)
    assert not e.blocks.ref and all(s.ref == 0 for s in e.prefix._by_key.values())


@pytest.fixture(scope="module")
def ckpt_chat(tmp_path_factory):
    return hc.make(tmp_path_factory.mktemp("chat") / "ckpt", TinyModelSpec(layers=4, seed=4))


def test_a_shared_system_prompt_is_reused_whole(ckpt_chat):
    tok = Tokenizer(ckpt_chat)
    start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    (nl,) = tok.encode("\n")
    low = max(start, end, nl) + 1  # content tokens: none of the break's

    def msg(n: int, seed: int) -> list[int]:
        return [start, *_rand(n, seed, low), end, nl]

    system = msg(300, 1)  # past the 256 grid, ends mid-page
    prompts = [system + msg(20, 10 + i) + [start, *_rand(3, 20 + i, low)] for i in range(3)]
    with LLM(ckpt_chat, dtype="float32", prefix_snapshot_interval=256) as llm:
        outs = [llm.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0] for p in prompts]
        _all_back(llm)
    # the second resumes before its first own message; it leaves a snapshot after the last page it
    # shares (its user turn's <|im_start|> included), where the third resumes
    assert [o.num_cached_tokens for o in outs] == [0, len(system), len(system) // 16 * 16 + 16]
    refs = [hc.hf_greedy(ckpt_chat, p, 6) for p in prompts]
    assert [o.output_token_ids for o in outs] == refs
    # sent at once: the first computes the system prompt, the others wait for its snapshot there
    with LLM(ckpt_chat, dtype="float32", prefix_snapshot_interval=256) as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        _all_back(llm)
    assert [o.num_cached_tokens for o in outs] == [0, len(system), len(system)]
    assert [o.output_token_ids for o in outs] == refs


def test_a_prompt_leaving_a_cached_one_mid_grid_leaves_a_snapshot_there(ckpt_hv2):
    """B departs from A after 150 tokens: B resumes at the grid (128) and saves its state after
    the last cached full page (144); C, departing at the same place, resumes there."""
    shared = _rand(150, 3)
    prompts = [shared + _rand(5, 30 + i) for i in range(3)]
    with LLM(ckpt_hv2, dtype="float32", prefix_snapshot_interval=64) as llm:
        outs = [llm.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0] for p in prompts]
        _all_back(llm)
    assert [o.num_cached_tokens for o in outs] == [0, 128, 144]
    for p, o in zip(prompts, outs):
        assert o.output_token_ids == hc.hf_greedy(ckpt_hv2, p, 6)

"""A prefix snapshot pool smaller than the points one prompt chunk reaches: the prompt's end gets
an entry before the grid points, so a conversation's next turn (whose history need not hold the
reply id for id, as a chat template's does not) resumes from the whole earlier prompt, and decodes
as transformers does."""

from __future__ import annotations

from engine import LLM, SamplingParams
from tests.helpers import hybrid_ckpt as hc

GREEDY8 = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_two_entry_pool_keeps_the_prompts_end(ckpt_hv2, llm_hv2, prompts):
    c = llm_hv2.capacity()
    snap = c.snapshot_bytes // c.num_snapshots
    budget = 16 * 2**20
    turn1 = prompts[6]  # 200 tokens: grid points 64, 128, 192 and the end, in one chunk
    turn2 = turn1 + [7] * 8 + prompts[4][:30]  # another "reply", then the next message
    with LLM(
        ckpt_hv2,
        dtype="float32",
        kv_cache_memory=budget,
        max_num_seqs=2,
        prefix_snapshot_interval=64,
        prefix_snapshot_memory=2.5 * snap / budget,
    ) as llm:
        assert llm.capacity().num_snapshots == 2
        llm.generate(prompt_token_ids=[turn1], sampling_params=GREEDY8)
        (out,) = llm.generate(prompt_token_ids=[turn2], sampling_params=GREEDY8)
        assert llm.engine.blocks.num_free == llm.capacity().num_blocks and llm.engine.slots.num_free == 2
    assert out.num_cached_tokens == len(turn1)  # it was 128: the pool's two entries went to 64 and 128
    assert out.output_token_ids == hc.hf_greedy(ckpt_hv2, turn2, 8)

"""Speculative verification in the engine: decode batches that mix plain rows and rows with
k drafts give the same tokens as plain decode, with GDN state rolled back on rejection."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.spec_decode import NgramProposer

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


class OracleProposer:
    """Drafts from the known greedy continuation, deliberately wrong at a rotating position,
    and no drafts at all for some requests and steps: every row shape the scheduler can build."""

    def __init__(self, prompts, refs):
        self.table = [(p, r) for p, r in zip(prompts, refs)]
        self.calls = 0
        self.rejected_any = False

    def __call__(self, tokens, k):
        self.calls += 1
        for i, (p, ref) in enumerate(self.table):
            if tokens[: len(p)] == p and len(tokens) - len(p) <= len(ref):
                done = len(tokens) - len(p)
                if i % 3 == 0 or self.calls % 5 == 0:
                    return []  # a plain row in the same batch
                drafts = list(ref[done : done + k])
                if drafts and self.calls % 2 == 0:
                    j = self.calls % len(drafts)
                    drafts[j] = (drafts[j] + 1) % 1024  # reject from position j on
                    self.rejected_any = True
                return drafts
        return []


@pytest.mark.parametrize("k", [1, 3])
def test_mixed_plain_and_speculative_rows_match_plain_decode(ckpt_hv2, prompts, llm_hv2, k):
    plain = [o.output_token_ids for o in llm_hv2.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    with LLM(ckpt_hv2, dtype="float32", num_speculative_tokens=k) as llm:
        oracle = OracleProposer(prompts, plain)
        llm.engine.proposer = oracle
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        assert [o.output_token_ids for o in outs] == plain
        assert oracle.rejected_any
        assert llm.engine.blocks.num_free == llm.capacity().num_blocks
        assert llm.engine.slots.num_free == llm.capacity().num_state_slots
        # fewer steps than tokens: drafts were accepted
        steps = 0
        for p in prompts[1:3]:  # rows the oracle drafts for
            llm.engine.add_request(p, GREEDY)
        while llm.engine.has_unfinished():
            llm.engine.step()
            steps += 1
        assert steps < 40


def test_ngram_speculation_on_repetitive_text(ckpt_hv2, llm_hv2):
    prompt = [[11, 12, 13, 14, 15] * 8]
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    plain = llm_hv2.generate(prompt_token_ids=prompt, sampling_params=sp)[0].output_token_ids
    with LLM(ckpt_hv2, dtype="float32", num_speculative_tokens=4) as llm:
        assert llm.generate(prompt_token_ids=prompt, sampling_params=sp)[0].output_token_ids == plain


def test_speculative_sampling_seeded_repeats(ckpt_hv2):
    sp = SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True)
    with LLM(ckpt_hv2, dtype="float32", num_speculative_tokens=2) as llm:
        llm.engine.proposer = lambda toks, k: toks[-k:]  # always something to verify
        a = llm.generate(prompt_token_ids=[[3, 1, 4, 1, 5, 9, 2, 6]], sampling_params=sp)[0].output_token_ids
        b = llm.generate(prompt_token_ids=[[3, 1, 4, 1, 5, 9, 2, 6]], sampling_params=sp)[0].output_token_ids
    assert a == b and len(a) == 24


def test_ngram_proposer():
    p = NgramProposer(1, 3)
    assert p([1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]
    assert p([5, 6, 7], 2) == []
    assert p([4, 4], 3) == [4]


def test_speculative_rows_under_tensor_parallel(ckpt_hv2, prompts, llm_hv2):
    """Rank 0 decides acceptance and broadcasts it; every rank rolls back its own shard."""
    few = prompts[1:5]
    plain = [o.output_token_ids for o in llm_hv2.generate(prompt_token_ids=few, sampling_params=GREEDY)]
    with LLM(ckpt_hv2, dtype="float32", num_speculative_tokens=2, tensor_parallel_size=2) as llm:
        oracle = OracleProposer(few, plain)
        llm.engine.proposer = oracle
        assert [o.output_token_ids for o in llm.generate(prompt_token_ids=few, sampling_params=GREEDY)] == plain
        assert oracle.rejected_any

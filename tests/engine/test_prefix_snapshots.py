"""Prefix snapshots without slowing prefill: a prompt longer than two snapshot intervals runs in
one step, and the snapshots it leaves (grid positions inside the chunk, written by the GDN
layers during the forward, and the prompt's end) equal those of a run whose chunks are one
interval long (each saved from the slot after its step), and so does the final state's (103 tokens:
the prompt and 3 of the 4 generated ones, saved when the request finishes). The kernels' states at inner positions
are checked against the naive per-token loops in tests/kernels/test_state_points.py."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.connector import Connector

INTERVAL, BS = 24, 16  # grid positions 24, 48, 72, 96 fall mid-page as well as on one (48, 96)
PROMPT = torch.randint(0, 1024, (100,), generator=torch.Generator().manual_seed(11)).tolist()
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _read(worker, entries):
    s = worker.pools.snapshots
    return {
        i: (
            [t[i].clone() for t in s.conv.values()],
            [t[i].clone() for t in s.recurrent.values()],
            [t[i].clone() for t in s.tail.values()],
        )
        for i in entries
    }


class _Chunks(Connector):
    """Records the tokens each scheduled row computes; transfers nothing."""

    def __init__(self, chunks: list[list[int]]) -> None:
        self.chunks = chunks

    def rows_scheduled(self, so) -> list[str]:
        self.chunks.append([r.num_new_tokens for r in so.rows])
        return []

    def tracks(self, request_id: str) -> bool:
        return False

    def abort(self, request_id: str, reason: str) -> bool:
        return False

    def poll(self) -> list:
        return []

    def has_work(self) -> bool:
        return False


def _run(ckpt, budget):
    chunks = []
    with LLM(ckpt, dtype="float32", max_num_batched_tokens=budget, prefix_snapshot_interval=INTERVAL) as llm:
        llm.engine.use_connector(_Chunks(chunks))  # hears every step's rows before it runs
        out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY)[0]
        keys = {s.num_tokens: s.index for s in llm.engine.prefix._by_key.values() if s.ready}
        snaps = llm.engine.executor.call_all(_read, list(keys.values()))[0]
    return chunks, out.output_token_ids, {n: snaps[i] for n, i in keys.items()}


def test_one_step_prefill_saves_the_same_snapshots_as_interval_chunks(ckpt_hv2):
    chunks, toks, snaps = _run(ckpt_hv2, 2048)
    ref_chunks, ref_toks, ref = _run(ckpt_hv2, INTERVAL)
    assert chunks[0] == [100] and len(chunks) == 4  # the whole prompt in one step, then 3 decode steps
    assert ref_chunks[:5] == [[24]] * 4 + [[4]]
    assert sorted(snaps) == sorted(ref) == [24, 48, 72, 96, 100, 103]
    assert toks == ref_toks
    for n in snaps:
        (conv, rec, tail), (rconv, rrec, rtail) = snaps[n], ref[n]
        for a, b in zip(conv + rec, rconv + rrec):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"GDN state after {n} tokens")
        # the partial page: tokens [n // BS * BS, n); the one-step run's page holds later ones too
        for a, b in zip(tail, rtail):
            torch.testing.assert_close(a[:, :, : n % BS], b[:, :, : n % BS], rtol=1e-4, atol=1e-5)


def test_a_failed_step_gives_back_its_snapshot_pins(ckpt_hv2):
    """The executor raises in a step that restores a snapshot and saves three: afterwards no
    snapshot is pinned, the three entries are free again (not visible half written), and the next
    request still resumes from the restored snapshot."""
    with LLM(ckpt_hv2, dtype="float32", prefix_snapshot_interval=INTERVAL) as llm:
        e = llm.engine
        llm.generate(prompt_token_ids=[PROMPT[:50]], sampling_params=GREEDY)  # snapshots at 24, 48, 50, 53
        assert e.prefix.num_used == 4
        seen, real = [], e.executor.execute

        def failing(step):
            seen.append(([c.index for c in step.restores], [c.offset for c in step.saves]))
            raise RuntimeError("a rank died")

        e.executor.execute = failing
        rid = e.add_request(PROMPT, GREEDY)
        with pytest.raises(RuntimeError, match="a rank died"):
            e.step()
        at50 = next(s.index for s in e.prefix._by_key.values() if s.num_tokens == 50)
        assert seen == [([at50], [22, 46, None])]  # resumes at 50; saves 72, 96 inside the chunk, 100 at its end
        e.abort(rid)
        assert all(s.ref == 0 for s in e.prefix._by_key.values()) and e.prefix.num_used == 4
        assert sorted(s.num_tokens for s in e.prefix._by_key.values()) == [24, 48, 50, 53]
        assert e.blocks.num_free == llm.capacity().num_blocks and not e.blocks.ref
        e.executor.execute = real
        out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY)[0]
        assert out.num_cached_tokens == 50

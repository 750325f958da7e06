"""Scheduling classes (engine/scheduler/priority.py): an interactive request that arrives behind
batch ones is admitted first and computes its prompt in a step of its own; batch prompt chunks get
at most batch_chunk_tokens a step (and what the measured rate computes in batch_step_s) while
interactive requests are about, whole steps otherwise; a
preempted batch request goes back behind the waiting interactive ones. The plan of each step is
checked row by row, and the tokens of a mixed-class run with a tiny step against transformers'."""

from __future__ import annotations

from engine.cache.block_manager import BlockManager, SlotPool
from engine.config import SchedulerConfig, SpeculativeConfig
from engine.request import Request, Status
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

STEP, CHUNK = 64, 16


def make(num_blocks: int = 64) -> tuple[Scheduler, BlockManager]:
    blocks = BlockManager(num_blocks, 4)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=STEP, batch_chunk_tokens=CHUNK)
    return Scheduler(cfg, blocks, SlotPool(8), 1000), blocks


def req(rid: str, n: int, priority: int, max_tokens: int = 4) -> Request:
    return Request(
        rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True, priority=priority)
    )


def step(s: Scheduler) -> list[tuple[str, int]]:
    """One step, planned and updated as the engine does (token 7 sampled); (id, tokens) per row
    in the order planned before the decode-first sort."""
    out = s.schedule()
    s.update(out, {r.request.request_id: [7] for r in out.rows if r.samples}, ())
    return sorted((r.request.request_id, r.num_new_tokens) for r in out.rows)


def test_batch_takes_whole_steps_while_no_interactive_is_about():
    s, _ = make()
    s.add(req("b1", 100, 1))
    s.add(req("b2", 100, 1))
    assert step(s) == [("b1", 64)]
    assert step(s) == [("b1", 36), ("b2", 28)]


def test_interactive_goes_first_in_a_step_of_its_own_then_batch_chunks_are_short():
    s, _ = make()
    s.add(req("b1", 200, 1))
    assert step(s) == [("b1", 64)]  # no interactive request yet: a whole step
    s.add(req("b2", 100, 1))
    s.add(req("i1", 40, 0))
    assert [r.request_id for r in s.waiting] == ["i1", "b2"]
    assert step(s) == [("i1", 40)]  # b1's next chunk waits: the step is the interactive prompt's
    # i1 decodes; batch prompts share CHUNK tokens a step, the running one first
    assert step(s) == [("b1", CHUNK), ("i1", 1)]
    s.add(req("i2", 10, 0))
    assert step(s) == [("i1", 1), ("i2", 10)]
    assert step(s) == [("b1", CHUNK), ("i1", 1), ("i2", 1)]


def test_interactive_arrived_recently_keeps_batch_chunks_short():
    s, _ = make()
    s.add(req("i1", 8, 0, max_tokens=1))
    assert step(s) == [("i1", 8)]
    s.add(req("b1", 100, 1))
    assert step(s) == [("b1", CHUNK)]  # i1 ended, but arrived within RECENT_S
    s.classes.last_interactive -= 60.0
    assert step(s) == [("b1", STEP)]


def test_preempted_batch_goes_back_behind_waiting_interactive():
    s, blocks = make(num_blocks=30)  # 120 tokens of KV
    b1, b2, i1 = req("b1", 60, 1, max_tokens=40), req("b2", 40, 1, max_tokens=40), req("i1", 12, 0)
    s.add(b1)
    s.add(b2)
    while blocks.num_free:
        step(s)  # no interactive yet: both prefill and decode until the pages run out
    s.add(i1)
    for _ in range(8):  # i1 finds no pages; the next page b1 or b2 needs preempts b2, the newest
        step(s)
        if b2.status is Status.PREEMPTED:
            break
    assert b2.status is Status.PREEMPTED and b1.status is Status.RUNNING
    assert [r.request_id for r in s.waiting] == ["i1", "b2"]
    assert ("i1", 12) in step(s)
    assert [r.request_id for r in s.running] == ["i1", "b1"]


def test_a_capped_batch_chunk_of_one_token_carries_no_drafts():
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=STEP, batch_chunk_tokens=1)
    spec = SpeculativeConfig(num_tokens=2)
    s = Scheduler(cfg, BlockManager(64, 4), SlotPool(8), 1000, 2, lambda toks, k: [99] * k, spec)
    s.add(req("i1", 4, 0, max_tokens=20))
    s.add(req("b1", 30, 1))
    assert step(s) == [("i1", 4)]
    step(s)  # b1 admitted with its first prompt token
    out = s.schedule()  # i1 decodes with its drafts; b1's prompt goes on, 1 token, no drafts
    rows = {r.request.request_id: r for r in out.rows}
    assert rows["b1"].num_new_tokens == 1 and rows["b1"].draft_token_ids == []
    assert rows["i1"].draft_token_ids == [99, 99]


def test_mixed_classes_small_steps_match_transformers(ckpt_hv2, prompts, hf_ref_hv2):
    from engine import LLM

    with LLM(ckpt_hv2, dtype="float32", max_num_batched_tokens=32, batch_chunk_tokens=8) as llm:
        params = [SamplingParams(max_tokens=48, temperature=0.0, priority=i % 2) for i in range(len(prompts))]
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for i, (o, want) in enumerate(zip(outs, hf_ref_hv2, strict=True)):
        assert o.output_token_ids == want, i


def test_batch_chunks_also_fit_the_time_of_a_step_at_the_measured_rate():
    from engine.scheduler.priority import MIN_BATCH_CHUNK, RATE_STEPS

    blocks = BlockManager(256, 4)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=STEP, batch_chunk_tokens=48, batch_step_s=0.01)
    s = Scheduler(cfg, blocks, SlotPool(8), 1000)
    s.add(req("b1", 400, 1))
    s.add(req("i1", 20, 0, max_tokens=64))
    assert step(s) == [("i1", 20)]
    assert step(s) == [("b1", 48), ("i1", 1)]  # nothing measured yet: batch_chunk_tokens
    for _ in range(RATE_STEPS):
        s.classes.observe(20, 0.01)  # 2,000 prompt tokens/s: 10 ms hold 20 tokens
    s.classes.observe(0, 5.0)  # a decode-only step says nothing of the prompt rate
    assert step(s) == [("b1", 20), ("i1", 1)]
    for _ in range(RATE_STEPS):
        s.classes.observe(10, 0.1)  # 100 tokens/s: not below MIN_BATCH_CHUNK, the batch still moves
    assert step(s) == [("b1", MIN_BATCH_CHUNK), ("i1", 1)]
    for _ in range(RATE_STEPS):
        s.classes.observe(1000, 0.01)  # fast: batch_chunk_tokens caps it again
    assert step(s) == [("b1", 48), ("i1", 1)]

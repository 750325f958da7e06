"""The persistent decode batch (docs/engine.md): a plain decode step over the same requests as the
last one reuses the scheduler's rows, moves the workers' RowInputs on in place, stages the graphs'
host buffers by moving them on, and reuses the sampler's plan. Each is checked against the path it
skips: the scheduler's general plan, `step_input`'s fresh rows, `stage`'s full write, a fresh
sampler plan, and greedy tokens against transformers. Requests of different lengths, sampled and
seeded, with penalties, logit_bias and a min_tokens that ends mid-run, open pages at different
steps and finish at different steps."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.model.graphs import DecodeGraphs
from engine.scheduler.batching import Scheduler
from engine.step_input import step_input
from tests.helpers import hybrid_ckpt as hc
from tests.helpers.decode_batch import assert_same_decode_batch

QWEN = dict(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return hc.make(tmp_path_factory.mktemp("persistent") / "ckpt", hc.SPEC_HV2)


def _work(priority: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """Six requests of different prompt and output lengths: greedy, Qwen-sampled with seeds, one
    unseeded (the longest, alone at the end), one with logit_bias, min_tokens and a repetition
    penalty."""
    prompts = hc.prompts(lens=(3, 17, 30, 5, 64, 9), seed=1)
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, priority=priority),
        SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True, priority=priority),
        SamplingParams(max_tokens=37, seed=7, ignore_eos=True, priority=priority, **QWEN),
        SamplingParams(max_tokens=29, seed=8, ignore_eos=True, priority=priority, **QWEN),
        SamplingParams(max_tokens=60, ignore_eos=True, priority=priority, **QWEN),
        SamplingParams(
            max_tokens=31, seed=9, logit_bias={5: 2.0}, min_tokens=12, repetition_penalty=1.2, priority=priority
        ),
    ]
    return prompts, params


def _run(
    path, monkeypatch, steady: bool = True, inspect=None, priority: int = 0, late=None, **engine
) -> tuple[list[int], list[list[int]]]:
    """The free pages after each step and every request's tokens; with steady False the
    persistent paths are off (the general path every step). KV pages of 4 tokens: rows open
    pages often, at different steps. late: (step, prompt, params) added before that step.
    engine: more LLM arguments."""
    with monkeypatch.context() as m:
        if not steady:
            m.setattr(Scheduler, "_steady", lambda self, allowance: None)
            m.setattr("engine.core.advance", lambda last, so: None)
        prompts, params = _work(priority)
        with LLM(path, dtype="float32", block_size=4, engine_process=False, seed=3, **engine) as llm:
            eng = llm.engine
            if inspect is not None:
                inspect(eng)
            rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
            trace: list[int] = []
            done: dict[str, list[int]] = {}
            while eng.has_unfinished():
                if late is not None and len(trace) == late[0]:
                    rids.append(eng.add_request(late[1], late[2]))
                for o in eng.step():
                    if o.finished:
                        done[o.request_id] = list(o.output_token_ids)
                trace.append(eng.blocks.num_free)
            assert eng.blocks.num_free == llm.capacity().num_blocks  # no page leaked
            assert eng.slots.num_free == llm.capacity().num_state_slots
    return trace, [done[r] for r in rids]


def _count_steady(counts: dict):
    def inspect(eng):
        real = eng._step_input

        def counted(so, layer_posts=None):
            step = real(so, layer_posts)
            counts["steady"] += step.steady
            return step

        eng._step_input = counted

    return inspect


def test_steady_steps_give_the_general_paths_tokens(ckpt, monkeypatch):
    """The same tokens (greedy, sampled with and without seeds, penalized, biased, under
    min_tokens), steps and page use with the persistent paths as without; the greedy rows are
    transformers' own generate."""
    counts = {"steady": 0}
    trace, got = _run(ckpt, monkeypatch, inspect=_count_steady(counts))
    ref_trace, ref = _run(ckpt, monkeypatch, steady=False)
    assert counts["steady"] >= 15, counts
    assert got == ref
    assert trace == ref_trace
    prompts, params = _work()
    assert [len(t) for t in got] == [p.max_tokens for p in params]
    for i in (0, 1):
        assert got[i] == hc.hf_greedy(ckpt, prompts[i], params[i].max_tokens)


# 6 GDN state slots and 40 KV pages of 4 tokens (the checkpoint's: 233,472 and 8,192 bytes):
# the six requests need 91 pages in all, so some wait for pages while the others decode. Batch
# prompt chunks capped by tokens alone, not by the measured prompt rate (a timing)
SHORT_OF_PAGES = dict(max_num_seqs=6, kv_cache_memory=6 * 233_472 + 40 * 8_192, batch_step_ms=0)


def test_steady_steps_while_requests_wait_for_pages(ckpt, monkeypatch):
    """Requests waiting for pages (fewer running than max_num_seqs) do not stop the steady path
    while none of them could start: the same tokens, page use and admission steps as the general
    path, which admits each waiting request as soon as pages free up, and an interactive request
    that arrives while batch ones wait at once (its short prompt fits where theirs do not)."""
    seen = {"steady": 0, "waiting": 0, "admitted": 0}

    def inspect(eng):
        sched = eng.scheduler
        real = sched.schedule

        def spy():
            before = len(sched.waiting)
            so = real()
            seen["steady"] += so.steady
            seen["waiting"] += so.steady and before > 0
            seen["admitted"] += len(sched.waiting) < before
            return so

        sched.schedule = spy

    late = (12, hc.prompts(lens=(2,), seed=5)[0], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    run = dict(priority=1, late=late, **SHORT_OF_PAGES)
    trace, got = _run(ckpt, monkeypatch, inspect=inspect, **run)
    ref_trace, ref = _run(ckpt, monkeypatch, steady=False, **run)
    assert got == ref
    assert trace == ref_trace  # admissions (and any preemption) at the same steps
    assert seen["waiting"] >= 10 and seen["admitted"] >= 2, seen
    prompts, params = _work()
    assert got[0] == hc.hf_greedy(ckpt, prompts[0], params[0].max_tokens)


def test_advanced_rows_equal_fresh_rows(ckpt, monkeypatch):
    """Each steady step's RowInputs equal what `step_input` builds for the same plan."""
    checked = []

    def inspect(eng):
        real = eng._step_input

        def both(so, layer_posts=None):
            step = real(so, layer_posts)
            if step.steady:
                fresh = step_input(so, False, 0, [])
                assert step.rows == fresh.rows
                assert fresh.plain
                checked.append(len(step.rows))
            return step

        eng._step_input = both

    _run(ckpt, monkeypatch, inspect=inspect)
    assert len(checked) >= 15 and len(set(checked)) >= 3  # steady steps at several batch sizes


def test_steady_staged_batches_equal_the_general_ones(ckpt, monkeypatch):
    """One DecodeGraphs (buffers only) stages every step; each steady step it moves the last
    step's host buffers on (`_advance`), packing the tables again when a row outgrows the packed
    width; each staged batch equals the worker's general one for the same rows."""
    stats = {"advanced": 0, "repacked": 0, "compared": 0}

    def inspect(eng):
        w = eng.executor.worker
        g = DecodeGraphs(w.model, w.pools, w.max_pages_per_row(), capture=False)
        real_adv, real_write = g._advance, g._write
        state = {"steady": False}

        def advance(*a):
            stats["advanced"] += 1
            return real_adv(*a)

        def write(*a):
            stats["repacked"] += state["steady"]
            return real_write(*a)

        g._advance, g._write = advance, write
        general = w.build_batch

        def both(step):
            w.graphs = g
            state["steady"] = step.steady and g.last_staged == len(step.rows)
            staged = g.stage(step.rows, w.block_tables, w.block_size, step.steady) if step.plain else None
            w.graphs = None
            ref = general(step)  # graphs off: the general path
            w.graphs = g if staged is not None else None
            if staged is None:
                g.last_staged = None
                return ref
            g.sizes[len(step.rows)].buffers.expand()
            assert_same_decode_batch(ref, staged)
            stats["compared"] += 1
            return staged

        w.build_batch = both
        w.graphs = None

    _run(ckpt, monkeypatch, inspect=inspect)
    assert stats["advanced"] >= 15, stats
    # pages of 4 tokens: the last request, alone for 20 steps, outgrows SLACK_PAGES more pages
    assert stats["repacked"] >= 1, stats
    assert stats["compared"] > stats["advanced"], stats


def test_a_changed_batch_is_not_advanced(ckpt):
    """A request added, finished or aborted between two steps ends the run of steady steps: the
    step after it is built afresh."""
    with LLM(ckpt, dtype="float32", engine_process=False) as llm:
        eng = llm.engine
        seen = []
        real = eng._step_input

        def spy(so, layer_posts=None):
            step = real(so, layer_posts)
            seen.append((step.steady, [r.request_id for r in step.rows]))
            return step

        eng._step_input = spy
        sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        a = eng.add_request(hc.prompts()[0], sp)
        b = eng.add_request(hc.prompts()[1], sp)
        for _ in range(4):
            eng.step()
        assert seen[-1][0] and sorted(seen[-1][1]) == sorted([a, b])
        eng.abort(a)
        eng.step()
        assert not seen[-1][0] and seen[-1][1] == [b]
        eng.step()
        assert seen[-1][0]
        c = eng.add_request(hc.prompts()[2], sp)
        eng.step()  # c's prompt
        eng.step()  # b and c decode: a new batch
        assert not seen[-1][0] and sorted(seen[-1][1]) == sorted([b, c])
        eng.step()
        assert seen[-1][0]
        eng.abort(b)
        eng.abort(c)
        while eng.has_unfinished():
            eng.step()

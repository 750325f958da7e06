"""A call given up midway (KeyboardInterrupt, an exception from a SIGALRM handler) leaves the
offline LLM as it was: in this process its requests are aborted, their memory back, and the next
call gives transformers' greedy tokens (it failed with KeyError on the old call's outputs); with
the engine in a process of its own the next call gets its own answer, not the old call's, and
without waiting for the old call's tokens (the child stops it between steps)."""

from __future__ import annotations

import signal
import time

import pytest

from engine import LLM, SamplingParams
from tests.helpers import hybrid_ckpt as hc

SHORT = [[5, 17, 300, 42], [1, 2, 3]]
SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
# a call that runs for minutes: interrupted long before its end
LONG = [[(7 * i + j) % 1000 for j in range(40)] for i in range(48)]
LONG_SP = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)


class Alarm(Exception):
    pass


def interrupted(call, after_s: float, exc: type[BaseException] = Alarm) -> None:
    """Run call() with `exc` raised from a SIGALRM handler after `after_s`; it must get it."""

    def handler(*_):
        raise exc

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, after_s)
    try:
        with pytest.raises(exc):
            call()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def want(ckpt_hv2):
    return [hc.hf_greedy(ckpt_hv2, p, 6) for p in SHORT]


@pytest.fixture(scope="module")
def llm(ckpt_hv2):
    with LLM(ckpt_hv2, dtype="float32", max_num_seqs=64) as llm:
        yield llm


def _free(llm):
    return llm.engine.blocks.num_free, llm.engine.slots.num_free


@pytest.mark.parametrize("after_s", [0.05, 0.3, 1.0])
def test_in_process_signal_interrupt_then_generate(llm, want, after_s):
    before = _free(llm)
    interrupted(lambda: llm.generate(prompt_token_ids=LONG, sampling_params=LONG_SP), after_s)
    assert not llm.engine.requests and _free(llm) == before
    assert [o.output_token_ids for o in llm.generate(prompt_token_ids=SHORT, sampling_params=SP)] == want


@pytest.mark.parametrize("at_step", [1, 3])
@pytest.mark.parametrize("method", ["generate", "compute_logits"])
def test_in_process_keyboard_interrupt_between_steps(llm, want, monkeypatch, method, at_step):
    before = _free(llm)
    step, calls = llm.engine.step, []

    def stepping():
        calls.append(1)
        out = step()
        if len(calls) == at_step:
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(llm.engine, "step", stepping)
    long_prompts = [[(3 * i + j) % 1000 for j in range(1500)] for i in range(4)]  # several prefill chunks
    with pytest.raises(KeyboardInterrupt):
        if method == "generate":
            llm.generate(prompt_token_ids=LONG, sampling_params=LONG_SP)
        else:
            llm.compute_logits(long_prompts)
    monkeypatch.undo()
    assert not llm.engine.requests and _free(llm) == before
    assert [o.output_token_ids for o in llm.generate(prompt_token_ids=SHORT, sampling_params=SP)] == want
    got = llm.compute_logits(SHORT[:1])[0]
    assert (got - hc.hf_last_logits(llm.config.model.path, SHORT[0])).abs().max().item() < 1e-3


def test_engine_process_interrupt_then_generate(ckpt_hv2, want):
    with LLM(ckpt_hv2, dtype="float32", engine_process=True, max_num_seqs=64) as llm:
        assert llm.engine is None
        for after_s in (1.0, 0.2):
            interrupted(lambda: llm.generate(prompt_token_ids=LONG, sampling_params=LONG_SP), after_s)
            t0 = time.monotonic()
            outs = llm.generate(prompt_token_ids=SHORT, sampling_params=SP)
            assert [o.output_token_ids for o in outs] == want  # its own answer, not the long call's
            assert [o.prompt_token_ids for o in outs] == SHORT
            assert time.monotonic() - t0 < 60  # the long call (48 x 3000 tokens) was stopped, not waited for
        interrupted(lambda: llm.generate(prompt_token_ids=LONG, sampling_params=LONG_SP), 0.5, KeyboardInterrupt)
        assert [o.output_token_ids for o in llm.generate(prompt_token_ids=SHORT, sampling_params=SP)] == want
        assert llm.capacity().num_blocks > 0

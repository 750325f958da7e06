"""Tensor-parallel ranks start from a fork server that imported torch once (engine/executor.py
`rank_context`): they see the environment of the executor that started them, and an executor
closes even when a signal to the node's group has stopped the fork server."""

from __future__ import annotations

import os
import signal
import time

from engine import LLM, SamplingParams
from tests.helpers.serve_harness import alive

MARK = "PDSERVE_TEST_RANK_MARK"


def _pids(worker) -> tuple[int, int]:
    return os.getpid(), os.getppid()


def _env(worker, name: str) -> str | None:
    return os.environ.get(name)


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=8, temperature=0.0))
    return [o.output_token_ids for o in outs]


def test_ranks_fork_from_one_server_with_the_executors_environment(ckpt_hv2, prompts, hf_ref_hv2, monkeypatch):
    ref = [r[:8] for r in hf_ref_hv2[:2]]
    with LLM(ckpt_hv2, dtype="float32", tensor_parallel_size=2, engine_process=False) as llm:
        pids = llm.engine.executor.call_all(_pids)
        servers = {pp for _, pp in pids}
        assert len(servers) == 1 and os.getpid() not in servers, pids  # both from one server, not from here
        (server,) = servers
        assert "libtorch" in open(f"/proc/{server}/maps").read()  # which had imported torch before they forked
        assert _tokens(llm, prompts[:2]) == ref
    monkeypatch.setenv(MARK, "set after the server started")
    with LLM(ckpt_hv2, dtype="float32", tensor_parallel_size=2, engine_process=False) as llm:
        ex = llm.engine.executor
        assert ex.call_all(_env, MARK) == ["set after the server started"] * 2
        ranks = [pid for pid, pp in ex.call_all(_pids)]
        assert {pp for _, pp in ex.call_all(_pids)} == {server}  # the same server, still running
        assert _tokens(llm, prompts[:2]) == ref
        os.kill(server, signal.SIGKILL)  # as a SIGTERM to a node's process group stops it
        t0 = time.monotonic()
        ex.close()
        assert time.monotonic() - t0 < 8.0
        deadline = time.monotonic() + 5.0
        while any(alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(p) for p in ranks), "a rank outlived its executor"
    with LLM(ckpt_hv2, dtype="float32", tensor_parallel_size=2, engine_process=False) as llm:  # a new server
        assert _tokens(llm, prompts[:2]) == ref

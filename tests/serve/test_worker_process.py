"""A node's model in a process of its own at TP 1 (`--worker-process`), in process: a real decode
node on the tiny checkpoint serves transformers' greedy tokens from a spawned rank while its engine
loop stays in the node, and stop() leaves no rank process behind; by default (and with
`--no-worker-process`) the model stays in the node's process."""

from __future__ import annotations

import argparse
import os

import grpc

from proto import pb, rpc


def _tokens(stub, prompt: list[int], new: int) -> list[int]:
    sp = pb.SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    out: list[int] = []
    for m in stub.Generate(pb.DecodeRequest(prompt_token_ids=prompt, sampling=sp), timeout=120):
        out += m.token_ids
    return out


def test_a_tp1_node_runs_its_model_in_a_rank_process(ckpt, refs):
    from decode_node.config import DecodeNodeConfig
    from decode_node.server import serve
    from engine.executor import MultiProcExecutor

    prompts, want = refs
    node, port = serve("127.0.0.1:0", DecodeNodeConfig(model=str(ckpt), dtype="float32", worker_process=True))
    try:
        ex = node.engine.executor
        assert isinstance(ex, MultiProcExecutor) and len(ex.procs) == 1
        rank = ex.procs[0]
        assert rank.is_alive() and rank.pid != os.getpid()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = rpc.DecodeNodeStub(ch)
            got = [_tokens(stub, p, len(w)) for p, w in zip(prompts, want)]
    finally:
        node.stop(0)
    assert got == want
    assert not rank.is_alive(), "the node stopped but its rank process lives on"


def test_by_default_the_model_stays_in_the_node(ckpt):
    from decode_node.config import DecodeNodeConfig
    from engine.executor import InProcExecutor, make_executor
    from engine.options import add_options, options, values

    ap = argparse.ArgumentParser()
    add_options(ap, options(DecodeNodeConfig))
    assert values(options(DecodeNodeConfig), ap.parse_args(["--worker-process"]))["worker_process"] is True
    assert values(options(DecodeNodeConfig), ap.parse_args(["--no-worker-process"]))["worker_process"] is False
    assert values(options(DecodeNodeConfig), ap.parse_args([]))["worker_process"] is False
    ex = make_executor(DecodeNodeConfig(model=str(ckpt)).engine_config())
    try:
        assert isinstance(ex, InProcExecutor)
    finally:
        ex.close()

"""Decode step time of the offline engine at TP 1 and TP 2 on the CPU, on a small checkpoint so
that what a step costs beyond its arithmetic (step inputs to the ranks, their answers, the
all-reduces) shows: the median wall time of `EngineCore.step()` over decode-only steps, and the
executor's share of it that is not a rank's forward (`execute` minus rank 0's step seconds); then
one all-reduce between two bare processes, gloo's and the shared-memory one the CPU ranks use
(engine/shm_all_reduce.py): the floor under TP 2's collectives on this machine.

    python bench/tp_step.py [--batch 8] [--steps 64] [--layers 2] [--hidden 128] [--prompt-len 16]
        [--sampled] [--tree CHECKOUT]"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the nodes run, before torch loads
CHAT = dict(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=16, help="tokens of each request's prompt (its context)")
    ap.add_argument("--sampled", action="store_true", help="Qwen's chat settings (a presence penalty), a seed each")
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]), help="the checkout whose engine runs")
    args = ap.parse_args()
    sys.path.insert(0, args.tree)
    from engine import LLM, SamplingParams
    from engine.tiny_model import TinyModelSpec, make_tiny_model

    spec = TinyModelSpec(
        layers=args.layers, hidden=args.hidden, intermediate=2 * args.hidden, tokenizer=False, full_attention_interval=2
    )
    with tempfile.TemporaryDirectory() as d:
        ckpt = make_tiny_model(Path(d) / "ckpt", spec)
        res = {}
        for tp in (1, 2):
            llm = LLM(
                str(ckpt),
                tensor_parallel_size=tp,
                enable_prefix_caching=False,
                max_model_len=args.prompt_len + args.steps + 64,
                kv_cache_memory="2GiB",
            )
            e = llm.engine
            ex = e.executor
            real = ex.execute
            spent: list[float] = []

            def timed(step, real=real, spent=spent):
                t0 = time.perf_counter()
                out = real(step)
                spent.append(time.perf_counter() - t0 - (out.seconds if out is not None else 0.0))
                return out

            ex.execute = timed
            how = CHAT if args.sampled else dict(temperature=0.0)
            for b in range(args.batch):
                sp = SamplingParams(max_tokens=args.steps + 8, ignore_eos=True, seed=b, **how)
                e.add_request([(7 * b + i) % 1000 + 1 for i in range(args.prompt_len)], sp)
            while any(not r.output_token_ids for r in e.requests.values()):  # the prompts
                e.step()
            for _ in range(3):
                e.step()
            walls = []
            spent.clear()
            for _ in range(args.steps):
                t0 = time.perf_counter()
                e.step()
                walls.append(time.perf_counter() - t0)
            res[tp] = (statistics.median(walls), statistics.median(spent))
            while e.has_unfinished():
                e.step()
            llm.close()
    load = os.getloadavg()
    print(
        f"batch {args.batch}, {args.layers} layers, hidden {args.hidden}, float32, {args.steps} decode steps, "
        f"prompts of {args.prompt_len} tokens, {'sampled' if args.sampled else 'greedy'}; "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    for tp, (wall, extra) in res.items():
        print(f"TP {tp}: step {wall * 1e3:.3f} ms (median), executor beyond rank 0's step {extra * 1e3:.3f} ms")
    print(f"TP 2 - TP 1: {(res[2][0] - res[1][0]) * 1e3:.3f} ms a step")
    for kind in ("gloo", "shm"):
        med, p90 = _allreduce_us(args.batch, args.hidden, kind)
        print(
            f"this machine: a {kind} all-reduce of {args.batch} x {args.hidden} float32 between two processes, "
            f"{med:.0f} us median, {p90:.0f} us p90 (what each of TP 2's all-reduces costs at least)"
        )


def _allreduce_us(rows: int, width: int, kind: str, calls: int = 300) -> tuple[float, float]:
    """Median and 90th percentile microseconds of one all-reduce (gloo's, or the shared-memory one:
    "shm") between two processes of one thread each (the TP 2 ranks' collective, alone)."""
    import multiprocessing as mp

    from engine import shm_all_reduce

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port() if kind == "gloo" else shm_all_reduce.create(2)
    ps = [ctx.Process(target=_allreduce_rank, args=(r, port, rows, width, calls, q)) for r in range(2)]
    for p in ps:
        p.start()
    got = q.get(timeout=120)
    for p in ps:
        p.join()
    if kind == "shm":
        os.unlink(str(port))
    return got


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _allreduce_rank(rank: int, where: int | str, rows: int, width: int, calls: int, q) -> None:
    """where: gloo's port, or the shared-memory all-reduce's buffer."""
    import torch
    import torch.distributed as dist

    from engine.shm_all_reduce import ShmAllReduce

    torch.set_num_threads(1)
    reduce: Callable[[torch.Tensor], object]
    if isinstance(where, int):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{where}", rank=rank, world_size=2)
        reduce = dist.all_reduce
    else:
        reduce = ShmAllReduce(where, rank, 2)
    x = torch.ones(rows, width)
    for _ in range(20):
        reduce(x)
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        reduce(x)
        ts.append(time.perf_counter() - t0)
    if isinstance(where, int):
        dist.destroy_process_group()
    if rank == 0:
        ts.sort()
        q.put((ts[len(ts) // 2] * 1e6, ts[len(ts) * 9 // 10] * 1e6))


if __name__ == "__main__":
    main()

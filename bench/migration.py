"""Migration benchmark (not a test): the gap a mid-stream migration adds to a stream (the decode
node SIGKILLed -> the client's next token), at prompt + output lengths of 1k and 8k tokens, with
and without the prompt in the new node's prefix cache. Two decode nodes that prefill locally
(`up --prefill 0`, least-loaded routing, so the warm-up lands on the other node); the tiny model
on CPU, float32.

    python bench/migration.py [--lens 1024 8192] [--after 64] [--trials 2]"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _free_port() -> int:
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return int(sk.getsockname()[1])


def _router_gap(port: int) -> tuple[float, float]:
    """(sum, count) of the router's migration_gap_seconds."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    samples = {x.name: x.value for x in fams["pdserve_router_migration_gap_seconds"].samples}
    return samples["pdserve_router_migration_gap_seconds_sum"], samples["pdserve_router_migration_gap_seconds_count"]


def one(model: str, total: int, after: int, hit: bool) -> tuple[float, float, int]:
    """(the gap the router measured, from the node's failure to the moved request's next token;
    the stream's time per token; the tokens it had sent when the node died)."""
    import torch

    from client import Client
    from router.launch import Cluster, PoolSpec

    g = torch.Generator().manual_seed(total)
    prompt = torch.randint(0, 1024, (total - after,), generator=g).tolist()
    mport = _free_port()
    spec = PoolSpec(
        model=model, prefill=0, decode=2, port=0, log_level="WARNING", node_options={"dtype": "float32"},
        router_options={"policy": "least-loaded", "metrics_port": mport},
    )  # fmt: skip
    with Cluster(spec, out=sys.stderr) as cl:
        cl.start()
        with Client(cl.address, timeout=600) as c:
            c.wait_ready(timeout=60)
            s = iter(c.stream(prompt_token_ids=prompt, max_tokens=total, temperature=0.0, ignore_eos=True))
            victim, n = next(s).decode_node, 1
            if hit:  # the same prompt on the other (idle) node: its prefix cache holds it
                w = c.generate(prompt_token_ids=prompt, max_tokens=1, temperature=0.0, ignore_eos=True)
                assert w.decode_node != victim, (w.decode_node, victim)
            while n < after:
                n += len(next(s).token_ids)
            cl.procs[victim].kill()
            tpot = 0.0
            for ch in s:
                n += len(ch.token_ids)
                tpot = ch.timings.tpot_s or tpot
            gap_sum, count = _router_gap(mport)
            assert count == 1 and n == total, (count, n)
    return gap_sum, tpot, after


def main() -> None:
    from engine.tiny_model import TinyModelSpec, make_tiny_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lens", type=int, nargs="+", default=[1024, 8192], help="prompt + output tokens at the kill")
    ap.add_argument("--after", type=int, default=64, help="output tokens streamed before the kill")
    ap.add_argument("--trials", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(Path(tmp) / "ckpt", TinyModelSpec(max_positions=3 * max(args.lens))))
        print("| prompt + output | prefix cache on the new node | gap (median ms) | gaps (ms) | tpot before (ms) |")
        print("|---|---|---|---|---|")
        for total in args.lens:
            for hit in (False, True):
                runs = [one(model, total, args.after, hit) for _ in range(args.trials)]
                gaps = [g * 1e3 for g, _, _ in runs]
                print(
                    f"| {total} | {'prompt cached' if hit else 'cold'} | {statistics.median(gaps):.0f} | "
                    f"{', '.join(f'{x:.0f}' for x in gaps)} | {statistics.median(t for _, t, _ in runs) * 1e3:.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()

"""What handing a decode step to the tensor-parallel ranks costs on the host as contexts grow:
the engine's write (pickling into the shared buffer) and one rank's read, milliseconds a step
(median over the steps), for decode rows whose page lists and, with --sampled, prompt and output
ids (a presence penalty's history) grow a token a step, through engine/step_channel.py as it
runs (tails) and pickled whole (the step as it is, what every step cost before). Not a test.

    python bench/step_channel.py [--batch 64] [--context 1024 8192 32768] [--steps 50] [--sampled]"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.sampling_params import SamplingParams  # noqa: E402
from engine.step import RowInput, StepInput  # noqa: E402
from engine.step_channel import StepReader, StepWriter  # noqa: E402

BLOCK = 16


def _rows(prompts, outputs, pages, params: list[SamplingParams], sampled: bool) -> list[RowInput]:
    return [
        RowInput(
            f"r{b}",
            [out[-1]],
            len(prompt) + len(out) - 1,
            b,
            pg,
            True,
            True,
            params=p,
            history=(prompt, out) if sampled else None,
            num_output=len(out),
        )
        for b, (prompt, out, pg, p) in enumerate(zip(prompts, outputs, pages, params))
    ]


def run(batch: int, context: int, steps: int, sampled: bool) -> tuple[float, float, float, float]:
    """(write, read) ms a step through the channel, then (dumps, loads) of the whole step."""
    prompts = [[(7 * b + i) % 1000 for i in range(context)] for b in range(batch)]
    outputs = [[1] for _ in range(batch)]
    chat = dict(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5)
    params = [SamplingParams(seed=b, **chat) if sampled else SamplingParams(temperature=0.0) for b in range(batch)]
    pages = [
        list(range(b * (context // BLOCK + 8), b * (context // BLOCK + 8) + context // BLOCK + 1)) for b in range(batch)
    ]
    w = StepWriter(size=64 << 20)
    r = StepReader(w.path)
    writes, reads, dumps, loads = [], [], [], []
    try:
        for i in range(steps):
            for b in range(batch):  # the step before: a token each, a page every BLOCK tokens
                outputs[b].append(i % 1000)
                if (context + i) % BLOCK == 0:
                    pages[b].append(pages[b][-1] + 1)
            step = StepInput(_rows(prompts, outputs, pages, params, sampled), [])
            t0 = time.perf_counter()
            msg = w.write(step)
            t1 = time.perf_counter()
            r.read(msg)
            t2 = time.perf_counter()
            blob = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
            t3 = time.perf_counter()
            pickle.loads(blob)
            t4 = time.perf_counter()
            if i:  # the first step sends every list whole
                writes.append(t1 - t0)
                reads.append(t2 - t1)
                dumps.append(t3 - t2)
                loads.append(t4 - t3)
    finally:
        r.close()
        w.close()
    return tuple(statistics.median(x) * 1e3 for x in (writes, reads, dumps, loads))  # type: ignore[return-value]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--sampled", action="store_true", help="rows carry their prompt and output ids (a penalty)")
    a = ap.parse_args()
    how = "sampled (prompt and output ids)" if a.sampled else "greedy (pages only)"
    print(f"batch {a.batch}, {how}, median of {a.steps - 1} steps, ms a step")
    for ctx in a.context:
        w, r, d, lo = run(a.batch, ctx, a.steps, a.sampled)
        print(f"context {ctx:6d}: tails write {w:7.3f} read {r:7.3f} | whole dumps {d:7.3f} loads {lo:7.3f}")


if __name__ == "__main__":
    main()

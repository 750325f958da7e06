"""Where a decode step's host time goes: the engine's step split into its phases (schedule, the
step's row inputs, the batch's device inputs, the forward or graph replay, the sampler with its
one host read, the scheduler's update, the outputs) at batch 1 and 64, median microseconds a
step, on the CPU or CUDA; then the Python functions by own time over the batch-64 steps
(cProfile). Greedy or Qwen's chat sampling (--sampled). Not a test.

    python bench/step_phases.py [--device cuda] [--batch 1 64] [--sampled] [--width model|tiny]
        [--graph-buffers] [--waiting N] [--mtp K]

`--width model` is bench/gpu_check.py's decode stack (4 layers at Qwen3.5-35B-A3B's widths);
`tiny` keeps the model's own time small so the host's stands out on the CPU. On CUDA the forward
phase is timed to its end (a synchronize after it), so the phases add up to the step.
`--graph-buffers` (the CPU): decode steps staged into the graphs' buffers as on CUDA (an upload,
the tables spread to their full width) and run eagerly on them, the host side of a graphed step
without a GPU; without it the CPU's own path (staged in place, packed tables). `--waiting N`: N
more requests wait while the batch decodes (overload: max_num_seqs is the batch plus N, and the
spare GDN state slots are taken away first). `--mtp K`: the checkpoint has an MTP block, which
drafts K tokens a step (random weights: most drafts are rejected and the depth policy soon
drafts none; "the rest" then holds the MTP block's pass)."""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the engine runs in this process (docs/benchmarks.md)

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.tiny_model import TinyModelSpec, make_tiny_model  # noqa: E402

_MODEL = dict(hidden=2048, intermediate=1024, heads=16, kv_heads=2, head_dim=256, linear_key_heads=16)
_TINY = dict(hidden=64, intermediate=64, heads=4, kv_heads=2, head_dim=16, linear_key_heads=2)
WIDTHS: dict[str, dict[str, Any]] = {
    "model": _MODEL | dict(linear_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128),
    "tiny": _TINY | dict(linear_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16),
}
CHAT = dict(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5)


class Phases:
    """Wraps bound methods with timers: label -> seconds of each call."""

    def __init__(self, sync) -> None:
        self.times: dict[str, list[float]] = collections.defaultdict(list)
        self.sync = sync

    def wrap(self, obj, name: str, label: str, sync: bool = False) -> None:
        f = getattr(obj, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            r = f(*a, **k)
            if sync:
                self.sync()
            self.times[label].append(time.perf_counter() - t0)
            return r

        setattr(obj, name, timed)


def run(
    device: str,
    batches: list[int],
    sampled: bool,
    width: str,
    steps: int,
    vocab: int,
    torch_profile: bool = False,
    buffers: bool = False,
    waiting: int = 0,
    mtp: int = 0,
) -> None:
    spec = TinyModelSpec(layers=4, vocab=vocab, dtype="bfloat16", tokenizer=False, seed=0, mtp=mtp > 0, **WIDTHS[width])
    drafts = dict(speculative_method="mtp", num_speculative_tokens=mtp) if mtp else {}

    def sync() -> None:  # not inside a graph's capture (the forward is captured on a later step)
        if device == "cuda" and not torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()

    with tempfile.TemporaryDirectory() as d:
        path = str(make_tiny_model(Path(d) / "ckpt", spec))
        seqs = max(64, max(batches) + waiting)
        llm = LLM(
            path,
            dtype="bfloat16",
            device=device,
            kv_cache_memory="2GiB",
            max_num_seqs=seqs,
            engine_process=False,
            **drafts,
        )
        with llm:
            eng = llm.engine
            w = eng.executor.worker
            if buffers and (w.graphs is None or w.graphs.packed):  # CUDA's staged steps, no graph (the CPU)
                from engine.model.graphs import DecodeGraphs

                w.graphs = DecodeGraphs(w.model, w.pools, w.max_pages_per_row(), capture=False)
            ph = Phases(sync)
            ph.wrap(eng.scheduler, "schedule", "schedule")
            ph.wrap(eng, "_step_input", "row inputs")
            ph.wrap(w, "build_batch", "batch inputs")
            graphs = getattr(w, "graphs", None)
            if graphs is not None:
                ph.wrap(graphs, "run", "forward (graphs)", sync=True)
            ph.wrap(w.model, "forward", "forward (eager)", sync=True)
            ph.wrap(w, "_sample", "sample + read")
            ph.wrap(eng.scheduler, "update", "update")
            ph.wrap(eng, "_output", "outputs")
            for B in batches:
                gen = torch.Generator().manual_seed(B)
                extra = CHAT if sampled else dict(temperature=0.0)
                rids = []
                for b in range(B):
                    p = SamplingParams(max_tokens=3 * steps + 16, ignore_eos=True, seed=b if sampled else None, **extra)
                    rids.append(eng.add_request(torch.randint(0, vocab, (128,), generator=gen).tolist(), p))
                while any(not eng.requests[r].output_token_ids for r in rids):
                    eng.step()
                held = _wait_for_slots(eng, waiting, vocab, gen) if waiting else []
                for _ in range(5):
                    eng.step()
                ph.times.clear()
                walls = []
                for _ in range(steps):
                    sync()
                    t0 = time.perf_counter()
                    eng.step()
                    sync()
                    walls.append(time.perf_counter() - t0)
                how = "qwen chat" if sampled else "greedy"
                med = statistics.median(walls)
                print(f"batch {B} ({device}, {width} widths, {how}): step {med * 1e6:.0f} us median", flush=True)
                total = 0.0
                for label, ts in ph.times.items():
                    per_step = sum(ts) / steps
                    total += per_step
                    print(f"  {label:18s} {per_step * 1e6:8.1f} us a step ({len(ts) / steps:.0f} calls)", flush=True)
                rest = statistics.median(walls) - total
                print(f"  {'the rest':18s} {rest * 1e6:8.1f} us a step (the step's own code, the executor)", flush=True)
                if B == max(batches):
                    prof = cProfile.Profile()
                    prof.enable()
                    for _ in range(steps):
                        eng.step()
                    prof.disable()
                    st = pstats.Stats(prof)
                    print(f"== cProfile, batch {B}, {steps} steps, by own time")
                    st.sort_stats("tottime").print_stats(30)
                    if torch_profile:
                        _torch_profile(eng, steps, device)
                for r in rids:
                    eng.abort(r)
                while eng.has_unfinished():
                    eng.step()
                for slot in held:
                    eng.slots.free(slot)


def _wait_for_slots(eng, waiting: int, vocab: int, gen) -> list[int]:
    """A node short of GDN state slots, as under overload: the free slots are taken away
    (returned, to give back), then `waiting` requests arrive, fewer running than max_num_seqs:
    they wait while the batch decodes."""
    held = [eng.slots.allocate() for _ in range(eng.slots.num_free)]
    p = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for _ in range(waiting):
        eng.add_request(torch.randint(0, vocab, (128,), generator=gen).tolist(), p)
    return held


def _torch_profile(eng, steps: int, device: str) -> None:
    """PyTorch's profiler over `steps` more steps: ops and runtime calls by host time (launches,
    copies, the one read's wait), then by device time on CUDA."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            eng.step()
        if device == "cuda":
            torch.cuda.synchronize()
    ka = prof.key_averages()
    print(f"== torch profiler, {steps} steps, by own host time")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=35))
    if device == "cuda":
        print(f"== torch profiler, {steps} steps, by device time")
        print(ka.table(sort_by="self_device_time_total", row_limit=20))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--sampled", action="store_true", help="Qwen's chat settings with a seed per request")
    ap.add_argument("--width", choices=sorted(WIDTHS), default="model")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--torch-profile", action="store_true", help="also PyTorch's profiler at the largest batch")
    ap.add_argument(
        "--graph-buffers", action="store_true", help="on the CPU: decode steps staged as for CUDA graphs (not captured)"
    )
    ap.add_argument(
        "--waiting", type=int, default=0, help="this many more requests wait for a state slot while the batch decodes"
    )
    ap.add_argument("--mtp", type=int, default=0, help="the checkpoint's MTP block drafts this many tokens a step")
    a = ap.parse_args()
    os.environ.setdefault("PDSERVE_CUDA_GRAPHS", "1")
    run(a.device, a.batch, a.sampled, a.width, a.steps, a.vocab, a.torch_profile, a.graph_buffers, a.waiting, a.mtp)


if __name__ == "__main__":
    main()

"""The start-up heap of a serving process, out of the garbage collector's way.

A node, a tensor-parallel rank, an engine process and the router each hold millions of objects
loaded once (torch, transformers, the model's modules, the tokenizer) that live as long as the
process. Python's cyclic collector walks all of them in every full collection, and the objects a
step or a streamed token makes trigger those often: a decode step of the CPU path spent 6-8% of
its time in the collector (docs/benchmarks.md, CPU path). `settle` moves what start-up left alive
to the collector's permanent generation (gc.freeze), so later collections walk only what requests
made. Called once a long-lived process is ready to serve, never in a caller's own process (an
in-process `LLM`): frozen objects that later become cyclic garbage stay until the process ends."""

from __future__ import annotations

import gc


def settle() -> int:
    """Collect once, then freeze every object still alive; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()

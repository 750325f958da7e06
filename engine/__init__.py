"""The engine shared by both node kinds: model, caches, scheduler, workers.

The names below load on first use (PEP 562), so `engine.config` and `engine.options` import
without torch (the command line is built from them).
"""

import importlib
import os

# OpenMP threads that finish a parallel region sleep instead of spinning (read when torch loads,
# so only when the engine is imported first; node processes inherit it). On a CPU whose cores
# are shared, a spinning thread takes the core another thread needs: measured on a 2-core
# machine under load, a 16 x 256-token bf16 prefill took 10.5 s with 2 spinning threads and
# 4.8 s passive, a 12-layer hidden-768 decode step 209 ms against 72 ms (docs/ARCHITECTURE.md).
import sys

# True when torch loaded before this package with no policy set: OpenMP kept its default
# (spinning) policy, and `LLM` on the CPU logs how to avoid it (engine/llm.py).
TORCH_LOADED_FIRST = "torch" in sys.modules and "OMP_WAIT_POLICY" not in os.environ
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _foreign_kernels() -> str | None:
    """Where another distribution named `kernels` is installed (Hugging Face's, which
    transformers>=5.25 requires), or None. It takes the import name of this project's kernels/:
    whichever of the two comes first on sys.path breaks the other (transformers' model imports in
    the repository, this engine everywhere else)."""
    for d in sys.path:
        if d and os.path.isdir(d):
            found = [n for n in os.listdir(d) if n.startswith("kernels-") and n.endswith(".dist-info")]
            if found:
                return os.path.join(d, found[0])
    return None


if (_found := _foreign_kernels()) is not None:
    raise ImportError(
        f"a package named `kernels` is installed ({_found}); it hides pdserve's kernels/ package. It comes with "
        "transformers>=5.25: run `pip uninstall -y kernels` (transformers' from_pretrained then needs "
        "USE_HUB_KERNELS=0), or install 'transformers>=5.3,<5.25' and uninstall it"
    )

_EXPORTS = {
    "LLM": "engine.llm",
    "CacheConfig": "engine.config",
    "EngineConfig": "engine.config",
    "ModelConfig": "engine.config",
    "ParallelConfig": "engine.config",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
    "SchedulerConfig": "engine.config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

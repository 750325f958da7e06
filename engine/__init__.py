"""The engine shared by both node kinds: model, caches, scheduler, workers.

The names below load on first use (PEP 562), so `engine.config` and `engine.options` import
without torch (the command line is built from them).
"""

import importlib

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

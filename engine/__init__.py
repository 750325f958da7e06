"""The engine shared by both node kinds: model, caches, scheduler, workers."""

import os

# OpenMP threads that finish a parallel region sleep instead of spinning (read when torch loads,
# so only when the engine is imported first; node processes inherit it). On a CPU whose cores
# are shared, a spinning thread takes the core another thread needs: measured on a 2-core
# machine under load, a 16 x 256-token bf16 prefill took 10.5 s with 2 spinning threads and
# 4.8 s passive, a 12-layer hidden-768 decode step 209 ms against 72 ms (docs/ARCHITECTURE.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig  # noqa: E402
from engine.llm import LLM
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CacheConfig",
    "EngineConfig",
    "ModelConfig",
    "ParallelConfig",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
]

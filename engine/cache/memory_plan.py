"""The cache budget planned from the device (`--gpu-memory-utilization`): a fraction of its memory,
this instance's share (vLLM's meaning: instances sharing a GPU each take their own fraction),
less its weights, the peak of a profile step and what it holds outside PyTorch, split by
`plan_capacity`. Pure: the measured figures come in as `DeviceFacts` (docs/engine.md, "Memory")."""

from __future__ import annotations

from dataclasses import dataclass

from engine.cache.allocator import Capacity, plan_capacity
from engine.cache.spec import CacheSpec


@dataclass(frozen=True)
class DeviceFacts:
    """What one rank measured, in bytes."""

    total: int  # the device's memory
    free_at_start: int  # free before this rank loaded anything (the rest: other processes, our context)
    weights: int  # held after the model was built (weights, persistent buffers)
    peak: int  # the profile steps' peak above that (activations, MoE/GDN scratch, the sampler)
    outside: int = 0  # taken during start-up outside PyTorch's allocator (NCCL, CUDA modules)
    graphs: int = 0  # the decode graphs' logits, each size's kept between replays (engine/model/graphs.py)

    @property
    def others(self) -> int:
        """Memory this rank found taken before it started."""
        return self.total - self.free_at_start


@dataclass(frozen=True)
class MemoryPlan:
    fraction: float
    facts: DeviceFacts
    budget: int  # bytes for snapshots, GDN state slots, speculative scratch, transfer staging and KV pages
    capacity: Capacity
    explicit: bool  # the budget is --kv-cache-memory, not the fraction's share

    def summary(self) -> str:
        f, c = self.facts, self.capacity
        source = "--kv-cache-memory" if self.explicit else f"{self.fraction:g} x {_size(f.total)}"
        return (
            f"memory plan ({source}): weights {_size(f.weights)}, profile peak {_size(f.peak)}, "
            f"outside PyTorch {_size(f.outside)}, decode graphs {_size(f.graphs)}, "
            f"other processes {_size(f.others)}; cache {_size(self.budget)} = {c.num_blocks} KV pages "
            f"({_size(c.kv_bytes)}, {c.max_tokens} tokens), {c.num_state_slots} GDN state slots "
            f"({_size(c.state_bytes)}), speculative scratch {_size(c.spec_scratch_bytes)}, "
            f"{c.num_snapshots} prefix snapshots ({_size(c.snapshot_bytes)}), transfer staging {_size(c.staging_bytes)}"
        )


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


def own_budget(facts: DeviceFacts, fraction: float, kv_cache_memory: int | None = None) -> int:
    """This rank's budget before any check: `kv_cache_memory` when given, else its share
    fraction x total less weights, peak and outside (may be <= 0). What other processes hold is
    not taken off: it is checked against the share at start (`plan_memory`)."""
    if kv_cache_memory is not None:
        return kv_cache_memory
    return int(fraction * facts.total) - (facts.weights + facts.peak + facts.outside + facts.graphs)


def plan_memory(
    facts: DeviceFacts,
    fraction: float,
    specs: list[CacheSpec],
    num_slots: int,
    block_size: int,
    num_spec_tokens: int = 0,
    snapshot_fraction: float = 0.0,
    snapshot_hidden: int = 0,
    padding: int = 0,
    staging_slots: int = 0,
    kv_cache_memory: int | None = None,
    agreed: int | None = None,
) -> MemoryPlan:
    """The budget is `own_budget`, or `agreed` where smaller (the smallest rank's: every rank's
    pools are the same size). A given `kv_cache_memory` must still fit in what the device has left.
    ValueError naming what to change when nothing is left for one KV page after the slots, the
    scratch and the snapshots."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1] (got {fraction})")
    used = facts.weights + facts.peak + facts.outside + facts.graphs + facts.others
    sizes = (
        f"weights {_size(facts.weights)}, profile peak {_size(facts.peak)}, outside PyTorch "
        f"{_size(facts.outside)}, decode graphs {_size(facts.graphs)}, other processes "
        f"{_size(facts.others)} of {_size(facts.total)}"
    )
    budget = own_budget(facts, fraction, kv_cache_memory)
    if agreed is not None and agreed < budget:
        budget = agreed
        sizes += f" (another tensor-parallel rank has only {_size(max(agreed, 0))} for its cache)"
    if kv_cache_memory is not None:
        left = facts.total - used
        if budget > left:
            raise ValueError(
                f"--kv-cache-memory {_size(budget)} does not fit: the device has {_size(left)} left after {sizes}; "
                "lower --kv-cache-memory, or leave it out to plan from --gpu-memory-utilization"
            )
    elif facts.free_at_start < int(fraction * facts.total):
        raise ValueError(
            f"--gpu-memory-utilization {fraction:g} asks for {_size(int(fraction * facts.total))} of the device's "
            f"{_size(facts.total)}, but only {_size(facts.free_at_start)} was free at start ({_size(facts.others)} "
            "held by other processes); lower --gpu-memory-utilization so that the instances sharing this GPU "
            "add up to at most what is free"
        )
    elif budget <= 0:
        raise ValueError(
            f"--gpu-memory-utilization {fraction:g} gives {_size(int(fraction * facts.total))}, and {sizes} "
            "leave nothing for the cache; raise --gpu-memory-utilization, lower --max-num-batched-tokens "
            "or --max-num-seqs, or raise --tp"
        )
    try:
        cap = plan_capacity(
            specs,
            budget,
            num_slots,
            block_size,
            num_spec_tokens,
            snapshot_fraction,
            snapshot_hidden,
            padding,
            staging_slots,
        )
    except ValueError as e:
        if kv_cache_memory is not None:
            raise
        raise ValueError(
            f"--gpu-memory-utilization {fraction:g} leaves a cache of {_size(budget)} after {sizes}, too small: {e}; "
            "raise --gpu-memory-utilization or lower --max-num-seqs"
        ) from None
    return MemoryPlan(fraction, facts, budget, cap, kv_cache_memory is not None)

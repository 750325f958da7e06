"""KV pages and GDN state slots: typed specs, the allocator and pools, free lists."""

from engine.cache.allocator import CachePools, Capacity, plan_capacity
from engine.cache.block_manager import BlockManager, SlotPool
from engine.cache.spec import CacheSpec, GDNStateSpec, MTPAttentionSpec, PagedAttentionSpec, build_specs

__all__ = [
    "BlockManager",
    "CachePools",
    "CacheSpec",
    "Capacity",
    "GDNStateSpec",
    "MTPAttentionSpec",
    "PagedAttentionSpec",
    "SlotPool",
    "build_specs",
    "plan_capacity",
]

"""One allocator for a model that mixes paged attention and GDN state slots: the per-rank budget
pays for the prefix snapshot pool, then the GDN state slots, and the rest becomes KV pages, one
pool tensor per layer allocated once (KV head-major, handed to the model as a permuted view).
Capacity in tokens counts only the groups that grow with length (docs/engine.md, "Module notes")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.cache.spec import CacheSpec, GDNStateSpec, PagedAttentionSpec, PrefixSnapshotSpec


@dataclass(frozen=True)
class Capacity:
    cache_bytes: int  # the budget
    state_bytes: int  # GDN state slots, all layers
    kv_bytes: int  # KV pages, all attention layers
    num_blocks: int
    block_size: int
    kv_bytes_per_token: int  # summed over the attention layers, MTP ones included (the only groups that grow)
    num_state_slots: int
    spec_scratch_bytes: int = 0  # per-token GDN states of speculative rows, for rollback
    num_snapshots: int = 0  # prefix-cache snapshots the snapshot pool holds
    snapshot_bytes: int = 0  # the snapshot pool, all layers
    snapshot_hidden: int = 0  # H: snapshots keep a hidden state for the MTP layer (0: none)
    # 1: one GDN state slot and one KV page past the counted ones, never handed out, which the rows
    # padding a decode step to its CUDA graph's batch size write (engine/model/graphs.py)
    padding: int = 0
    # the transfer sender's bfloat16 staging of float32 recurrent states, all GDN layers
    # (transfer/staging.py: `staging_slots` slots each); 0 where the states are not float32
    staging_bytes: int = 0

    @property
    def max_tokens(self) -> int:
        """Tokens the KV pages hold, across all requests."""
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> int:
        """Requests that can be live at once (one GDN state slot each)."""
        return self.num_state_slots

    def summary(self) -> str:
        mib = 2**20
        spec = f", speculative scratch {self.spec_scratch_bytes / mib:.1f} MiB" if self.spec_scratch_bytes else ""
        if self.snapshot_bytes:
            spec += f"; {self.num_snapshots} prefix snapshots ({self.snapshot_bytes / mib:.1f} MiB)"
        if self.padding:
            spec += "; one more slot and page for padded decode rows"
        if self.staging_bytes:
            spec += f"; transfer staging {self.staging_bytes / mib:.1f} MiB"
        return (
            f"cache {self.cache_bytes / mib:.1f} MiB: {self.num_blocks} KV blocks x {self.block_size} tokens "
            f"= {self.max_tokens} tokens ({self.kv_bytes_per_token} B/token over attention layers, "
            f"{self.kv_bytes / mib:.1f} MiB); {self.num_state_slots} GDN state slots "
            f"({self.state_bytes / mib:.1f} MiB) bound concurrency to {self.max_concurrency}{spec}"
        )


def plan_capacity(
    specs: list[CacheSpec],
    budget: int,
    num_slots: int,
    block_size: int,
    num_spec_tokens: int = 0,
    snapshot_fraction: float = 0.0,
    snapshot_hidden: int = 0,
    padding: int = 0,
    staging_slots: int = 0,
) -> Capacity:
    """snapshot_hidden: the hidden size when MTP drafts (each snapshot keeps one hidden state).
    padding 1: the budget pays for one slot and one page more than it counts (`Capacity.padding`).
    staging_slots: the transfer sender's bfloat16 staging slots for float32 recurrent states
    (`staging_bytes`), paid from the budget like the state slots."""
    if staging_slots < 0:
        raise ValueError(f"transfer staging slots must be >= 0 (got {staging_slots})")
    attn = [s for s in specs if isinstance(s, PagedAttentionSpec)]
    gdn = [s for s in specs if isinstance(s, GDNStateSpec)]
    state_bytes = num_slots * sum(s.page_size_bytes for s in gdn)
    scratch = num_slots * (num_spec_tokens + 1) * sum(s.page_size_bytes for s in gdn) if num_spec_tokens else 0
    block_bytes = sum(s.page_size_bytes for s in attn)
    if not attn:
        raise ValueError("the model has no full-attention layer; pdserve serves hybrid models")
    snap = PrefixSnapshotSpec.of(specs, snapshot_hidden).page_size_bytes
    num_snapshots = int(budget * snapshot_fraction) // snap
    snapshot_bytes = num_snapshots * snap
    pad_bytes = padding * (sum(s.page_size_bytes for s in gdn) + block_bytes)
    staging = staging_slots * sum(staging_slot_bytes(s) for s in gdn)
    num_blocks = (budget - state_bytes - scratch - snapshot_bytes - pad_bytes - staging) // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory={budget} B leaves no room for KV pages after {num_slots} GDN state slots "
            f"({state_bytes + scratch} B with speculative scratch), {snapshot_bytes} B of prefix snapshots, "
            f"{staging} B of transfer staging and one {block_bytes} B block; "
            "raise kv_cache_memory or lower max_num_seqs"
        )
    return Capacity(
        cache_bytes=budget,
        state_bytes=state_bytes,
        kv_bytes=num_blocks * block_bytes,
        num_blocks=int(num_blocks),
        block_size=block_size,
        kv_bytes_per_token=block_bytes // block_size,
        num_state_slots=num_slots,
        spec_scratch_bytes=scratch,
        num_snapshots=num_snapshots,
        snapshot_bytes=snapshot_bytes,
        snapshot_hidden=snapshot_hidden if num_snapshots else 0,
        padding=padding,
        staging_bytes=staging,
    )


def staging_slot_bytes(spec: GDNStateSpec) -> int:
    """One transfer staging slot of a GDN layer: its recurrent state in bfloat16, where the pool
    holds it in float32 (the one cast the transfer plans, transfer/plan.py CASTS); else 0."""
    if spec.recurrent_dtype != torch.float32:
        return 0
    return spec.recurrent_bytes // spec.recurrent_dtype.itemsize * torch.bfloat16.itemsize


def kv_pool_view(storage: torch.Tensor) -> torch.Tensor:
    """Head-major storage [KVH, num_blocks, 2, bs, hd] -> the kernels' [num_blocks, 2, KVH, bs, hd] view."""
    return storage.permute(1, 2, 0, 3, 4)


def kv_storage(pool: torch.Tensor) -> torch.Tensor:
    """The contiguous head-major tensor behind a pool view made by `kv_pool_view`."""
    storage = pool.permute(2, 0, 1, 3, 4)
    if not storage.is_contiguous():
        raise ValueError(
            f"KV pool {tuple(pool.shape)} with strides {pool.stride()} is not a view of contiguous "
            "head-major storage [KVH, num_blocks, 2, block_size, hd]"
        )
    return storage


class CachePools:
    """Per-layer pools: kv[layer] for attention, conv[layer] + recurrent[layer] for GDN.

    kv[layer] is the kernels' view [num_blocks, 2, KVH, bs, hd] of head-major storage.
    """

    def __init__(
        self, specs: list[CacheSpec], capacity: Capacity, device: str | torch.device = "cpu", num_spec_tokens: int = 0
    ):
        self.specs = {s.layer: s for s in specs}
        self.capacity = capacity
        self.kv: dict[int, torch.Tensor] = {}
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        # speculative rows: the state after every verified token, row-indexed [rows, k+1, ...]
        self.conv_scratch: dict[int, torch.Tensor] = {}
        self.recurrent_scratch: dict[int, torch.Tensor] = {}
        # (slot, page) that padded decode rows write, past the counted ones (`Capacity.padding`)
        self.pad: tuple[int, int] | None = (capacity.num_state_slots, capacity.num_blocks) if capacity.padding else None
        for s in specs:  # zeroed: pages and slots never hold NaN, even before first use
            if isinstance(s, PagedAttentionSpec):
                pages = capacity.num_blocks + capacity.padding
                storage = torch.zeros(s.storage_shape(pages), dtype=s.dtype, device=device)
                self.kv[s.layer] = kv_pool_view(storage)
            else:
                n = capacity.num_state_slots + capacity.padding
                self.conv[s.layer] = torch.zeros((n, *s.conv_shape), dtype=s.conv_dtype, device=device)
                self.recurrent[s.layer] = torch.zeros((n, *s.recurrent_shape), dtype=s.recurrent_dtype, device=device)
                if num_spec_tokens:
                    k1, m = num_spec_tokens + 1, capacity.num_state_slots
                    self.conv_scratch[s.layer] = torch.zeros((m, k1, *s.conv_shape), dtype=s.conv_dtype, device=device)
                    self.recurrent_scratch[s.layer] = torch.zeros(
                        (m, k1, *s.recurrent_shape), dtype=s.recurrent_dtype, device=device
                    )

        self.snapshots = SnapshotPool(
            PrefixSnapshotSpec.of(specs, capacity.snapshot_hidden), capacity.num_snapshots, device
        )

    def rollback(self, rows: list[tuple[int, int, int]]) -> None:
        """(slot, decode row, index) per speculative row that kept only part of its drafts: the
        slot takes the state after token `index` of that row, in every GDN layer."""
        for layer, conv in self.conv.items():
            for slot, row, idx in rows:
                conv[slot].copy_(self.conv_scratch[layer][row, idx])
                self.recurrent[layer][slot].copy_(self.recurrent_scratch[layer][row, idx])

    def tensors(self) -> list[tuple[str, int, torch.Tensor]]:
        """(kind, layer, tensor) for every pool: what the transfer layer registers. Each tensor
        is contiguous and covers its whole allocation (KV: the head-major storage, not the view)."""
        out = [(self.specs[i].kind, i, kv_storage(t)) for i, t in self.kv.items()]
        out += [("gdn_conv", i, t) for i, t in self.conv.items()]
        out += [("gdn_recurrent", i, t) for i, t in self.recurrent.items()]
        return sorted(out, key=lambda x: (x[1], x[0]))


class SnapshotPool:
    """The prefix snapshots' memory (`PrefixSnapshotSpec`), M entries, and the two copies that
    use it: `save` (a slot's GDN state + a request's partial page -> entry) after a step's
    forward, `restore` (entry -> a slot + a fresh page) before it. Not part of `tensors()`:
    snapshots never travel. With MTP drafting an entry also keeps the hidden state at the
    prefix's last token (`SnapshotCopy.last`)."""

    def __init__(self, spec: PrefixSnapshotSpec, num: int, device: str | torch.device = "cpu"):
        self.spec, self.num = spec, num
        self.conv = {s.layer: torch.zeros((num, *s.conv_shape), dtype=s.conv_dtype, device=device) for s in spec.gdn}
        self.recurrent = {
            s.layer: torch.zeros((num, *s.recurrent_shape), dtype=s.recurrent_dtype, device=device) for s in spec.gdn
        }
        self.tail = {s.layer: torch.zeros(s.pool_shape(num), dtype=s.dtype, device=device) for s in spec.attention}
        self.hidden = torch.zeros((num, spec.hidden_size), dtype=spec.hidden_dtype, device=device)

    def save(self, pools: CachePools, copies, hidden: dict[int, torch.Tensor] | None = None) -> None:
        """copies: `SnapshotCopy`s (index, slot, page or None, offset). Those with an offset
        had their GDN state written by the forward: only their page is copied here. hidden:
        entry index -> the hidden state to keep (MTP)."""
        self._copy(pools, [c for c in copies if c.offset is None], to_snapshot=True)
        self._copy_pages(pools, [c for c in copies if c.offset is not None], to_snapshot=True)
        for i, h in (hidden or {}).items():
            self.hidden[i].copy_(h)

    def restore(self, pools: CachePools, copies) -> None:
        self._copy(pools, copies, to_snapshot=False)

    def _copy(self, pools: CachePools, copies, to_snapshot: bool) -> None:
        if not copies:
            return
        dev = next(iter(self.conv.values())).device if self.conv else None
        pairs = [(c.slot, c.index) if to_snapshot else (c.index, c.slot) for c in copies]  # (source, destination)
        ix = None  # on CUDA: one gather and one scatter per pool, by these (source, destination) indices
        if dev is not None and dev.type == "cuda":
            ix = tuple(torch.tensor(x, device=dev) for x in zip(*pairs))
        for layer in self.conv:
            for snap, pool in ((self.conv[layer], pools.conv[layer]), (self.recurrent[layer], pools.recurrent[layer])):
                src, dst = (pool, snap) if to_snapshot else (snap, pool)
                if ix is not None:
                    dst.index_copy_(0, ix[1], src.index_select(0, ix[0]))
                else:  # entry by entry: no temporary (a fresh one costs its pages' first touch, more than the copy)
                    for a, b in pairs:
                        dst[b].copy_(src[a])
        self._copy_pages(pools, copies, to_snapshot)

    def _copy_pages(self, pools: CachePools, copies, to_snapshot: bool) -> None:
        paged = [c for c in copies if c.page is not None]
        for layer, tail in self.tail.items():
            kv = pools.kv[layer]  # a strided view: copy page by page
            for c in paged:
                if to_snapshot:
                    tail[c.index].copy_(kv[c.page])
                else:
                    kv[c.page].copy_(tail[c.index])

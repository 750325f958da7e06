"""The sender's staging regions for the one cast a plan declares (`transfer.plan.CASTS`): a float32
GDN recurrent pool feeding a bfloat16 destination is cast, one request slot at a time, into a
registered bfloat16 region laid out as the pool but with `TransferConfig.staging_slots` slots, and
the WRITEs read from there. Owns those regions (made and registered at the first peer that needs
them), their slots (one per request from its cast until its writes are over) and the cast."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

import msgspec
import torch

from transfer.backend import Transport, byte_view
from transfer.plan import RegionPair, src_key


class Staging:
    """Staging regions of one sender endpoint, keyed as `src_key` names them."""

    def __init__(self, transport: Transport, views: dict[tuple[int, str], torch.Tensor] | None, slots: int) -> None:
        self.transport = transport
        self.views = views  # the endpoint's byte views for checksums (None: no checksum)
        self.slots = slots
        self.regions: dict[tuple[int, str], torch.Tensor] = {}
        self.free_slots = list(range(slots - 1, -1, -1))  # popped from the end: 0 first

    def allocate(self) -> int | None:
        """A staging slot for one request, or None while every one is held."""
        return self.free_slots.pop() if self.free_slots else None

    def free(self, slot: int) -> None:
        """Give a request's slot back: called once no write of that request can still read it."""
        if not 0 <= slot < self.slots or slot in self.free_slots:
            raise ValueError(f"staging slot {slot} is not held (slots 0..{self.slots - 1})")
        self.free_slots.append(slot)

    def bind(self, pairs: tuple[RegionPair, ...]) -> tuple[RegionPair, ...]:
        """`pairs` with each cast pair's source pointing at its staging region (made now if new)."""
        new: dict[tuple[int, str], torch.Tensor] = {}
        for p in pairs:
            key = src_key(p)
            if p.cast and key not in self.regions:
                pool = self.transport.regions[(p.layer, p.kind)]
                shape = (self.slots, *pool.shape[1:])
                new[key] = torch.zeros(shape, dtype=getattr(torch, p.cast), device=pool.device)
        if new:
            self.transport.add_regions(new)
            self.regions.update(new)
            if self.views is not None:
                self.views.update({k: byte_view(t) for k, t in new.items()})
        out = []
        for p in pairs:
            if p.cast:
                t = self.regions[src_key(p)]
                if t.stride(0) * t.element_size() != p.src.page_stride:
                    raise ValueError(f"staging of {p.kind} layer {p.layer} does not match its plan's layout")
                nbytes = t.numel() * t.element_size()
                src = msgspec.structs.replace(p.src, base_addr=t.data_ptr(), num_pages=self.slots, nbytes=nbytes)
                p = p._replace(src=src)  # noqa: PLW2901
            out.append(p)
        return tuple(out)

    def cast(self, pairs: Iterable[RegionPair], slot: int, stage: int, done: set[tuple[int, str]]) -> None:
        """Cast pool slot `slot` of each cast pair into staging slot `stage`, once per region
        (`done` holds those already cast for this request). Called after the step's fence (or the
        layer's device event): the copy reads the final state and has landed when this returns."""
        devices = set()
        for p in pairs:
            key = src_key(p)
            if not p.cast or key in done:
                continue
            pool = self.transport.regions[(p.layer, p.kind)]
            self.regions[key][stage].copy_(pool[slot])  # rounds to nearest even, as Tensor.to
            done.add(key)
            if pool.device.type == "cuda":
                devices.add(pool.device)
        for d in devices:  # the WRITE reads the staging memory directly, off every stream
            torch.cuda.current_stream(d).synchronize()


def casts_in(
    channels: Iterable[tuple[Sequence[RegionPair], Collection[int]]], layers: Collection[int] | None, final: bool
) -> bool:
    """Whether a whole-layer post (`layers`, None: every one; `final`: the rest) writes a cast pair
    not yet written on any channel, given each channel's (pairs, indices already written)."""
    return any(
        p.cast and i not in sent and (final or layers is None or p.layer in layers)
        for pairs, sent in channels
        for i, p in enumerate(pairs)
    )

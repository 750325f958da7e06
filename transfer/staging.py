"""The sender's staging regions for the one cast a plan declares (`transfer.plan.CASTS`): a float32
GDN recurrent pool feeding a bfloat16 destination is cast, one request slot at a time, into a
registered bfloat16 region laid out as the pool, and the WRITEs read from there. Owns those
regions (made and registered at the first peer that needs them) and the cast itself."""

from __future__ import annotations

from collections.abc import Iterable

import msgspec
import torch

from transfer.backend import Transport, byte_view
from transfer.plan import RegionPair, src_key


class Staging:
    """Staging regions of one sender endpoint, keyed as `src_key` names them."""

    def __init__(self, transport: Transport, views: dict[tuple[int, str], torch.Tensor] | None) -> None:
        self.transport = transport
        self.views = views  # the endpoint's byte views for checksums (None: no checksum)
        self.regions: dict[tuple[int, str], torch.Tensor] = {}

    def bind(self, pairs: tuple[RegionPair, ...]) -> tuple[RegionPair, ...]:
        """`pairs` with each cast pair's source pointing at its staging region (made now if new)."""
        new: dict[tuple[int, str], torch.Tensor] = {}
        for p in pairs:
            key = src_key(p)
            if p.cast and key not in self.regions:
                pool = self.transport.regions[(p.layer, p.kind)]
                new[key] = torch.zeros(pool.shape, dtype=getattr(torch, p.cast), device=pool.device)
        if new:
            self.transport.add_regions(new)
            self.regions.update(new)
            if self.views is not None:
                self.views.update({k: byte_view(t) for k, t in new.items()})
        out = []
        for p in pairs:
            if p.cast:
                t = self.regions[src_key(p)]
                if t.shape[0] * t.stride(0) * t.element_size() != p.src.nbytes:
                    raise ValueError(f"staging of {p.kind} layer {p.layer} does not match its plan's layout")
                p = p._replace(src=msgspec.structs.replace(p.src, base_addr=t.data_ptr()))  # noqa: PLW2901
            out.append(p)
        return tuple(out)

    def cast(self, pairs: Iterable[RegionPair], slot: int, done: set[tuple[int, str]]) -> None:
        """Cast `slot` of each cast pair's pool into its staging region, once per region (`done`
        holds those already cast for this request). Called after the step's fence (or the
        layer's device event): the copy reads the final state and has landed when this returns."""
        devices = set()
        for p in pairs:
            key = src_key(p)
            if not p.cast or key in done:
                continue
            pool = self.transport.regions[(p.layer, p.kind)]
            self.regions[key][slot].copy_(pool[slot])  # rounds to nearest even, as Tensor.to
            done.add(key)
            if pool.device.type == "cuda":
                devices.add(pool.device)
        for d in devices:  # the WRITE reads the staging memory directly, off every stream
            torch.cuda.current_stream(d).synchronize()

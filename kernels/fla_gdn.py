"""flash-linear-attention's chunked gated delta rule behind `kernels.gdn.gdn_chunk_prefill`'s
arguments: on CUDA, when fla is installed and the step keeps no states inside rows, the engine
runs GDN prefill through it (the H200 figures in docs/benchmarks.md put it ahead of our Triton
kernel at every measured shape); `PDSERVE_GDN_PREFILL=pdserve` keeps our kernel. The state pool
layout is the same ([slots, Hv, dk, dv]); rows without an initial state start from zeros."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import cache

import torch

log = logging.getLogger("pdserve.kernels")

CHOICES = ("auto", "fla", "pdserve")


def choice() -> str:
    c = os.environ.get("PDSERVE_GDN_PREFILL", "auto")
    if c not in CHOICES:
        raise ValueError(f"PDSERVE_GDN_PREFILL must be one of {', '.join(CHOICES)} (got {c!r})")
    return c


@cache
def _fla_chunk() -> Callable | None:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # not installed, or built for another torch / triton
        log.info("GDN prefill: our Triton kernel (flash-linear-attention unavailable: %s)", type(e).__name__)
        return None
    log.info("GDN prefill: flash-linear-attention's chunk_gated_delta_rule")
    return chunk_gated_delta_rule


def usable(q: torch.Tensor, points) -> bool:
    """Whether this call goes to fla: CUDA, no states kept inside rows, fla importable, not
    switched off."""
    if not q.is_cuda or points is not None:
        return False
    c = choice()
    if c == "pdserve":
        return False
    fn = _fla_chunk()
    if fn is None and c == "fla":
        raise RuntimeError("PDSERVE_GDN_PREFILL=fla but flash-linear-attention does not import: pip install fla-core")
    return fn is not None


def gdn_chunk_prefill_fla(
    q, k, v, g, beta, cu_seqlens, init: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's chunked rule over packed rows: q, k already expanded to v's Hv heads, init [B, Hv,
    dk, dv] float32 -> (o [T, Hv, dv] in v's dtype, final states [B, Hv, dk, dv] float32).
    kernels.gdn.gdn_chunk_prefill reads and writes the pool around it."""
    fn = _fla_chunk()
    assert fn is not None
    dt = torch.promote_types(q.dtype, v.dtype)  # fla wants one dtype: the engine's q, k are float32
    o, final = fn(
        q.to(dt)[None],
        k.to(dt)[None],
        v.to(dt)[None],
        g.float()[None],
        beta.to(dt)[None],
        scale=scale,
        initial_state=init,
        output_final_state=True,
        cu_seqlens=cu_seqlens.long(),
    )
    return o[0].to(v.dtype), final

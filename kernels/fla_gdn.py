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
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    has_initial_state: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """kernels.gdn.gdn_chunk_prefill's contract (o [T, Hv, dv] in v's dtype; final states into
    state_pool[slot_ids]) through fla. q, k [T, Hk, dk] are expanded to Hv heads."""
    fn = _fla_chunk()
    assert fn is not None
    hv, hk = v.shape[1], q.shape[1]
    if hk != hv:
        q, k = q.repeat_interleave(hv // hk, 1), k.repeat_interleave(hv // hk, 1)
    init = state_pool.index_select(0, slot_ids).float()
    if has_initial_state is not None:  # where(), not a multiply: a never-written slot may hold NaN
        init = torch.where(has_initial_state[:, None, None, None], init, torch.zeros((), device=init.device))
    dt = torch.promote_types(q.dtype, v.dtype)  # fla wants one dtype: the engine's q, k are float32
    o, final = fn(
        q.to(dt)[None],
        k.to(dt)[None],
        v.to(dt)[None],
        g.float()[None],
        beta.to(dt)[None],
        scale=q.shape[-1] ** -0.5 if scale is None else scale,
        initial_state=init,
        output_final_state=True,
        cu_seqlens=cu_seqlens.long(),
    )
    state_pool.index_copy_(0, slot_ids, final.to(state_pool.dtype))
    return o[0].to(v.dtype)

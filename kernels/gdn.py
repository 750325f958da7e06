"""Gated DeltaNet ops, PyTorch path, slot-indexed state: `gdn_chunk_prefill` (chunk-parallel over
packed sequences, optionally keeping states at points inside them) and `gdn_recurrent` (token by
token, rows of 1..k+1 tokens, per-token states for rollback). Shapes and the recurrence:
docs/kernels.md, "Module notes", and docs/DESIGN.md §3."""

from __future__ import annotations

import torch

from kernels import fla_gdn
from kernels.checks import check_gdn_inputs, check_points_dtype
from kernels.points import StatePoints, check_points
from kernels.triton import force_triton as _force_triton

__all__ = [
    "l2norm",
    "gdn_chunk_prefill",
    "gdn_recurrent",
    "gdn_decode_step_",
    "expand_heads",
    "pad_packed",
    "unpad_packed",
]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last axis, in float32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def expand_heads(x: torch.Tensor, hv: int) -> torch.Tensor:
    """[..., Hk, d] -> [..., Hv, d]: each key head serves Hv/Hk consecutive value heads."""
    hk = x.shape[-2]
    return x if hk == hv else x.repeat_interleave(hv // hk, dim=-2)


def _pad_index(cu_seqlens: torch.Tensor, padded_len: int, total: int) -> torch.Tensor:
    """[B, padded_len] index into a packed tensor with one zero row appended at `total`."""
    starts = cu_seqlens[:-1, None]
    lens = (cu_seqlens[1:] - cu_seqlens[:-1])[:, None]
    pos = torch.arange(padded_len, device=cu_seqlens.device)[None, :]
    return torch.where(pos < lens, starts + pos, torch.full_like(pos, total))


def pad_packed(x: torch.Tensor, cu_seqlens: torch.Tensor, padded_len: int) -> torch.Tensor:
    """Packed [T, ...] -> [B, padded_len, ...], zeros after each sequence's end (a view when
    every sequence is padded_len long)."""
    B = cu_seqlens.numel() - 1
    if x.shape[0] == B * padded_len:
        return x.view(B, padded_len, *x.shape[1:])
    if B == 1:
        return torch.cat([x, x.new_zeros((padded_len - x.shape[0], *x.shape[1:]))])[None]
    xz = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])
    return xz[_pad_index(cu_seqlens, padded_len, x.shape[0])]


def unpad_packed(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[B, L, ...] -> packed [T, ...] keeping the first len_b positions of row b."""
    B, L = x.shape[:2]
    T = int(cu_seqlens[-1])
    if T == B * L or B == 1:
        return x[:, : T // B].reshape(T, *x.shape[2:]).contiguous()
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    row = torch.repeat_interleave(torch.arange(len(lens), device=x.device), lens)
    col = torch.arange(int(cu_seqlens[-1]), device=x.device) - cu_seqlens[:-1][row]
    return x[row, col]


_GROUP_ELEMS = 1 << 17  # elements of a [G, B, H, C, C] temporary in the CPU chunked prefill


def _initial_states(state_pool, slot_ids, has_initial_state):
    s = state_pool.index_select(0, slot_ids).float()
    if has_initial_state is None:
        return s
    # where(), not a multiply: a never-written slot may hold NaN.
    return torch.where(has_initial_state[:, None, None, None], s, torch.zeros((), dtype=s.dtype, device=s.device))


def gdn_chunk_prefill(
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
    chunk_size: int | None = None,
    points: StatePoints | None = None,
    points_pool: torch.Tensor | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Chunked gated delta rule over packed variable-length sequences.

    Returns o [T, Hv, dv] in v's dtype; writes each sequence's final state into
    state_pool[slot_ids]. Sequences with has_initial_state False start from zero.
    chunk_size None: 64 for the Triton kernel, 32 here (smaller [C, C] work, faster on CPUs).
    points, when given, name states inside the sequences to write into points_pool
    [N, Hv, dk, dv] (state_pool's dtype) as well (kernels/points.py). The state is computed in
    float32 whatever the pools' dtype (float32 or bfloat16) and rounded only where stored. max_len: the longest row, when the
    caller knows it on the host (the Triton path then reads nothing back, kernels/checks.py).
    """
    if q.is_cuda and fla_gdn.usable(q, points):
        check_gdn_inputs(q, k, v, g, beta, cu_seqlens, state_pool, slot_ids, max_len)
        hv = v.shape[1]
        init = _initial_states(state_pool, slot_ids, has_initial_state)
        sc = q.shape[-1] ** -0.5 if scale is None else scale
        qe, ke = expand_heads(q, hv), expand_heads(k, hv)
        o, final = fla_gdn.gdn_chunk_prefill_fla(qe, ke, v, g, beta, cu_seqlens, init, sc)
        state_pool.index_copy_(0, slot_ids, final.to(state_pool.dtype))
        return o
    if q.is_cuda or _force_triton():
        from kernels.triton.gdn_chunk import gdn_chunk_prefill_triton

        args = (q, k, v, g, beta, cu_seqlens, state_pool, slot_ids, has_initial_state, scale, chunk_size or 64)
        return gdn_chunk_prefill_triton(*args, points=points, points_pool=points_pool, max_len=max_len)
    check_gdn_inputs(q, k, v, g, beta, cu_seqlens, state_pool, slot_ids)
    if points is not None:
        check_points(points, cu_seqlens, points_pool, state_pool.shape[1:])
        check_points_dtype(points_pool, state_pool)
    T, hv, dv = v.shape
    dk = q.shape[-1]
    scale = dk**-0.5 if scale is None else scale
    B = cu_seqlens.numel() - 1
    C = chunk_size or 32
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    n_chunks = max(1, -(-int(lens.max()) // C))
    L = n_chunks * C

    def chunks(x):  # packed [T, H, d] -> [N, B, H, C, d], chunk-major, zeros after each sequence's end
        x = pad_packed(x, cu_seqlens, L)
        return x.view(B, n_chunks, C, hv, -1).permute(1, 0, 3, 2, 4).contiguous()

    # Padding rows carry k = 0, beta = 0, g = 0: they neither decay nor write the state.
    Q = chunks(expand_heads(q, hv).float() * scale)
    K = chunks(expand_heads(k, hv).float())
    V = chunks(v.float())
    gamma = chunks(g.float()[..., None])[..., 0].cumsum_(-1)  # [N, B, H, C] in-chunk cumsum of g
    bet = chunks(beta.float()[..., None])  # [N, B, H, C, 1]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()

    S = _initial_states(state_pool, slot_ids, has_initial_state)
    O = torch.empty_like(V)
    at_chunk: dict[int, list[tuple[int, int, int]]] = {}  # chunk -> (sequence, index in chunk, dest)
    if points is not None and points.num_points:
        for b, off, d in zip(points.seq().tolist(), points.offsets.tolist(), points.dest.tolist()):
            at_chunk.setdefault((off - 1) // C, []).append((b, (off - 1) % C, d))
    # Chunks go in groups small enough for the [G, B, H, C, C] temporaries to stay in cache.
    G = max(1, min(n_chunks, _GROUP_ELEMS // (B * hv * C * C)))
    for n0 in range(0, n_chunks, G):
        Qg, Kg, Vg, gam, bg = Q[n0 : n0 + G], K[n0 : n0 + G], V[n0 : n0 + G], gamma[n0 : n0 + G], bet[n0 : n0 + G]
        # Gamma_ij = exp(gamma_i - gamma_j) for i >= j, else 0. Clamped at -80 so that exp never
        # underflows (slow on CPUs); e^-80 is as good as zero next to the diagonal's 1.
        decay = (gam[..., :, None] - gam[..., None, :]).clamp_(-80.0, 0.0).exp_().masked_fill_(~causal, 0.0)
        kb = Kg * bg
        Kt = Kg.transpose(-1, -2)
        A = (kb @ Kt).mul_(decay)  # diagonal ignored by the unit-triangular solve
        eg = gam.exp()[..., None]
        rhs = torch.cat([Vg * bg, kb.mul_(eg)], dim=-1)
        sol = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
        U, W = sol[..., :dv], sol[..., dv:]  # U = T diag(beta) V ; W = T diag(beta e^gamma) K
        intra = (Qg @ Kt).mul_(decay)
        Qd = Qg * eg
        last = gam[..., -1:]  # [G, B, H, 1]
        KdT = (Kg * (last - gam).exp_()[..., None]).transpose(-1, -2)
        chunk_decay = last.exp()[..., None]  # [G, B, H, 1, 1]
        for n in range(Qg.shape[0]):
            vn = U[n] - W[n] @ S
            O[n0 + n] = Qd[n] @ S + intra[n] @ vn
            for b, j, d in at_chunk.get(n0 + n, ()):  # the state after in-chunk token j
                gj = gam[n, b, :, j : j + 1]  # [H, 1]
                kd = Kg[n, b, :, : j + 1] * (gj - gam[n, b, :, : j + 1]).exp()[..., None]
                Sj = S[b] * gj.exp()[..., None] + kd.transpose(-1, -2) @ vn[b, :, : j + 1]
                points_pool[d] = Sj
            S = S * chunk_decay[n] + KdT[n] @ vn

    state_pool.index_copy_(0, slot_ids, S.to(state_pool.dtype))
    out = O.permute(1, 0, 3, 2, 4).reshape(B, L, hv, dv)
    return unpad_packed(out, cu_seqlens).to(v.dtype)


def gdn_decode_step_(q, k, v, g, beta, state: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """One token per row, updating `state` [B, Hv, dk, dv] float32 in place (it may be a
    contiguous run of a pool's slots: no gather, no scatter). Returns o [B, Hv, dv]."""
    B, hv, dk, dv = state.shape
    hk = q.shape[1]
    scale = dk**-0.5 if scale is None else scale
    S = state.view(B, hk, hv // hk, dk, dv)
    S.mul_(g.float().exp().view(B, hk, -1, 1, 1))
    kk = k.float().view(B, hk, 1, 1, dk)
    pred = (kk @ S).view(B, hv, dv)
    delta = (v.float() - pred).mul_(beta.float()[..., None])
    # S += k delta^T per value head, in place and broadcast over the heads sharing a key head
    S.addcmul_(kk.view(B, hk, 1, dk, 1), delta.view(B, hk, -1, 1, dv))
    qq = q.float() if scale == 1.0 else q.float() * scale
    out = (qq.view(B, hk, 1, 1, dk) @ S).view(B, hv, dv)
    return out.to(v.dtype)


def gdn_recurrent(
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
    intermediate_states: torch.Tensor | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Token-by-token gated delta rule for decode rows of 1..n tokens each.

    intermediate_states, when given, is [B, n_max, Hv, dk, dv] (the pool's dtype) and receives the state
    after every token of each row (entries past a row's length are left as they were), so a
    rejected speculative suffix can roll back to the state after the last accepted token.
    Returns o [T, Hv, dv]; writes the final state of each row into state_pool[slot_ids].
    max_len: the longest row, when the caller knows it (as gdn_chunk_prefill).
    """
    if q.is_cuda or _force_triton():
        from kernels.triton.gdn_recurrent import gdn_recurrent_triton

        args = (q, k, v, g, beta, cu_seqlens, state_pool, slot_ids, has_initial_state, scale, intermediate_states)
        return gdn_recurrent_triton(*args, max_len=max_len)
    check_gdn_inputs(q, k, v, g, beta, cu_seqlens, state_pool, slot_ids)
    T, hv, dv = v.shape
    dk = q.shape[-1]
    scale = dk**-0.5 if scale is None else scale
    B = cu_seqlens.numel() - 1
    S = _initial_states(state_pool, slot_ids, has_initial_state)

    if T == B:  # every row has exactly one token: one vectorised step on the gathered states
        out = gdn_decode_step_(q, k, v, g, beta, S, scale)
        if intermediate_states is not None:
            intermediate_states[:, 0] = S
        state_pool.index_copy_(0, slot_ids, S.to(state_pool.dtype))
        return out

    qf = expand_heads(q, hv).float() * scale
    kf = expand_heads(k, hv).float()
    vf, gf, bf = v.float(), g.float(), beta.float()
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    n_max = int(lens.max())
    Qp, Kp, Vp = (pad_packed(x, cu_seqlens, n_max) for x in (qf, kf, vf))
    Gp, Bp = pad_packed(gf, cu_seqlens, n_max), pad_packed(bf, cu_seqlens, n_max)
    Op = torch.empty_like(Vp)
    for t in range(n_max):  # padded steps have g = 0, beta = 0, k = 0: state unchanged
        S = S * Gp[:, t].exp()[:, :, None, None]
        delta = (Vp[:, t] - torch.einsum("bhkv,bhk->bhv", S, Kp[:, t])) * Bp[:, t][..., None]
        S = S + Kp[:, t][..., None] * delta[:, :, None, :]
        Op[:, t] = torch.einsum("bhkv,bhk->bhv", S, Qp[:, t])
        if intermediate_states is not None:
            live = (t < lens)[:, None, None, None]
            intermediate_states[:, t] = torch.where(live, S, intermediate_states[:, t])
    state_pool.index_copy_(0, slot_ids, S.to(state_pool.dtype))
    return unpad_packed(Op, cu_seqlens).to(v.dtype)

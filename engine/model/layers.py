"""The three blocks of a Qwen3.5 decoder layer, on one tensor-parallel rank.

Weights are already sharded and fused by the loader; projections are `Linear`s (called as
`w(x)`, layout chosen per dtype in engine/model/linear.py):
    GDN        w_in = [qkv_r | z_r | b_r | a_r], conv weight [D_r, Kc], A_log, dt_bias, norm, w_out
    attention  w_qkv = [q_and_gate_r | k_r | v_r], q_norm, k_norm, w_o
    MLP        w_gate_up = [gate_r | up_r], w_down
Row-parallel outputs (GDN out_proj, o_proj, down_proj) are summed over ranks by `all_reduce`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from engine.cache.allocator import CachePools
from engine.model.batch import ForwardBatch
from engine.model.linear import Linear
from engine.model.rotary import apply_rotary_
from kernels import (
    causal_attention,
    causal_conv1d,
    causal_conv1d_update,
    conv_update_,
    cpu_ops,
    gated_rms_norm,
    gdn_chunk_prefill,
    gdn_decode_step_,
    gdn_recurrent,
    paged_attention,
    store_kv,
)

AllReduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class GDNWeights:
    w_in: Linear
    conv: torch.Tensor  # [D_r, Kc]
    A_log: torch.Tensor  # [Hv_r]
    dt_bias: torch.Tensor  # [Hv_r]
    norm: torch.Tensor  # [dv]
    w_out: Linear  # [hidden, Hv_r * dv]


@dataclass
class AttentionWeights:
    w_qkv: Linear
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    w_o: Linear


@dataclass
class MLPWeights:
    w_gate_up: Linear
    w_down: Linear


def _per_group(batch: ForwardBatch, x, fn):
    """Run fn(group, x[group's tokens]) for the decode and prefill groups, joining the results.
    x is a tensor or a tuple of tensors split the same way."""
    groups = batch.groups
    parts = x if isinstance(x, tuple) else (x,)
    if len(groups) == 1:
        return fn(groups[0], *parts)
    outs = [fn(g, *(p[g.tok_start : g.tok_end] for p in parts)) for g in groups]
    return torch.cat(outs)


def _pick(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return x if rows is None else x[rows]


class GatedDeltaNet:
    def __init__(
        self,
        layer: int,
        w: GDNWeights,
        hk: int,
        hv: int,
        dk: int,
        dv: int,
        eps: float,
        all_reduce: AllReduce,
        invariant: bool = False,
    ):
        """invariant (--batch-invariant): a prompt's tokens through the recurrent kernel, one at a
        time as a decode step computes them (the C `gdn_rows` on the CPU, `gdn_recurrent` on CUDA)."""
        self.layer, self.invariant = layer, invariant
        self.w, self.hk, self.hv, self.dk, self.dv, self.eps = w, hk, hv, dk, dv, eps
        self.all_reduce = all_reduce
        self.key_dim, self.value_dim = hk * dk, hv * dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.neg_A = -w.A_log.float().exp()
        self.dt_bias = w.dt_bias.float()
        # the C ops' trailing arguments (gdn_rows, gdn_decode, gdn_verify)
        self.c_consts = (self.neg_A, self.dt_bias, w.norm, hk, hv, dk, dv, eps)
        self.qk_scale = torch.tensor([1.0 / dk] * hk + [dk**-0.5] * hk, device=w.w_in.device)[:, None]

    def _conv(self, pools, grp, qkv):
        conv_pool = pools.conv[self.layer]
        if grp.decode and grp.max_row_tokens > 1:  # speculative rows: keep the state after each token
            scratch = pools.conv_scratch[self.layer][: grp.num_rows]
            return causal_conv1d(
                qkv,
                self.w.conv,
                grp.cu_seqlens,
                conv_pool,
                grp.slot_ids,
                None,
                True,
                scratch,
                max_len=grp.max_row_tokens,
            )
        if grp.decode and grp.slot_start is not None and not qkv.is_cuda:
            return conv_update_(qkv, self.w.conv, conv_pool[grp.slot_start : grp.slot_start + grp.num_rows])
        if grp.decode:
            return causal_conv1d_update(qkv, self.w.conv, conv_pool, grp.slot_ids)
        snaps = pools.snapshots.conv.get(self.layer) if grp.points is not None else None
        rows = (grp.cu_seqlens, conv_pool, grp.slot_ids, grp.has_initial_state)
        kw = dict(points=grp.points, points_pool=snaps, max_len=grp.max_row_tokens)
        return causal_conv1d(qkv, self.w.conv, *rows, **kw)

    def _delta_rule(self, pools, grp, q, k, v, g, beta):
        rec_pool = pools.recurrent[self.layer]
        if grp.decode and grp.max_row_tokens > 1:
            scratch = pools.recurrent_scratch[self.layer][: grp.num_rows]
            return gdn_recurrent(
                q, k, v, g, beta, grp.cu_seqlens, rec_pool, grp.slot_ids, None, 1.0, scratch, max_len=grp.max_row_tokens
            )
        if grp.decode and grp.slot_start is not None and not q.is_cuda and rec_pool.dtype == torch.float32:
            return gdn_decode_step_(q, k, v, g, beta, rec_pool[grp.slot_start : grp.slot_start + grp.num_rows], 1.0)
        if grp.decode:
            return gdn_recurrent(q, k, v, g, beta, grp.cu_seqlens, rec_pool, grp.slot_ids, scale=1.0, max_len=1)
        if self.invariant and q.is_cuda:  # the CPU's invariant prefill is gdn_rows (above)
            return self._recurrent_prefill(pools, grp, q, k, v, g, beta)
        snaps = pools.snapshots.recurrent.get(self.layer) if grp.points is not None else None
        rows = (grp.cu_seqlens, rec_pool, grp.slot_ids, grp.has_initial_state)
        kw = dict(points=grp.points, points_pool=snaps, max_len=grp.max_row_tokens)
        return gdn_chunk_prefill(q, k, v, g, beta, *rows, scale=1.0, **kw)

    def _recurrent_prefill(self, pools, grp, q, k, v, g, beta) -> torch.Tensor:
        """A prefill group through `gdn_recurrent`, token by token as decode steps run (the float32
        state is exact between calls); with prefix snapshots inside rows, in phases cut at them
        (`RowGroup.point_phases`), each point's state copied into the snapshot pool after its phase."""
        rec_pool = pools.recurrent[self.layer]
        if grp.points is None:
            rows = (grp.cu_seqlens, rec_pool, grp.slot_ids, grp.has_initial_state)
            return gdn_recurrent(q, k, v, g, beta, *rows, scale=1.0, max_len=grp.max_row_tokens)
        snaps = pools.snapshots.recurrent[self.layer]
        o = v.new_empty(v.shape)
        for idx, (cu, slots, init, _), copies in grp.point_phases():
            if idx.numel():
                part = (x.index_select(0, idx) for x in (q, k, v, g, beta))
                o.index_copy_(0, idx, gdn_recurrent(*part, cu, rec_pool, slots, init, scale=1.0))
            for slot, entry in copies:
                snaps[entry].copy_(rec_pool[slot])
        return o

    def _rows_in_phases(self, proj, batch: ForwardBatch, pools: CachePools, consts) -> torch.Tensor:
        """cpu_ops.gdn_rows phase by phase; after each, the states at the points it ended on are
        copied from the rows' slots into the snapshot pools."""
        out = proj.new_empty(proj.shape[0], self.hv * self.dv)
        conv, rec = pools.conv[self.layer], pools.recurrent[self.layer]
        conv_snap, rec_snap = pools.snapshots.conv[self.layer], pools.snapshots.recurrent[self.layer]
        for idx, rows, copies in batch.gdn_row_phases():
            out.index_copy_(0, idx, cpu_ops.gdn_rows(proj.index_select(0, idx), *rows, *consts))
            for slot, entry in copies:
                conv_snap[entry].copy_(conv[slot])
                rec_snap[entry].copy_(rec[slot])
        return out

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, pools: CachePools, rows: torch.Tensor | None = None):
        """rows: only these tokens' outputs are wanted (every token still updates the state)."""
        T = x.shape[0]
        proj = self.w.w_in(x)
        fused = not x.is_cuda and cpu_ops.available(x.dtype)
        if (
            fused and batch.prefill is not None and (batch.decode is None or batch.decode.max_row_tokens == 1)
        ):  # prefill chunks (and decode rows beside them) token by token in C, float32 arithmetic
            # on model-dtype inputs (bfloat16 rounds where the decode step does: docs/engine.md)
            consts = (self.w.conv, pools.conv[self.layer], pools.recurrent[self.layer], *self.c_consts)
            if batch.prefill.points is None:
                o = cpu_ops.gdn_rows(proj, *batch.gdn_rows(), *consts)
            elif cpu_ops.points_in_pass(pools.recurrent[self.layer], self.dk, self.dv):  # snapshots in the pass
                snaps = (pools.snapshots.conv[self.layer], pools.snapshots.recurrent[self.layer])
                o = cpu_ops.gdn_rows_points(
                    proj, batch.gdn_rows(), *consts[:3], self.c_consts, batch.gdn_row_points(), *snaps
                )
            else:  # prefix snapshots inside rows: in phases cut at them (ForwardBatch.gdn_row_phases)
                o = self._rows_in_phases(proj, batch, pools, consts)
            return self.all_reduce(self.w.w_out(_pick(o, rows)))
        # decode rows, fused in C; speculative rows keep float32 states for rollback in C, so a
        # bfloat16 state (bfloat16 rollback buffers) verifies them on the PyTorch path below
        grp = batch.decode
        f32_state = pools.recurrent[self.layer].dtype == torch.float32
        pre = batch.prefill
        if fused and f32_state and pre is not None and grp is not None and pre.points is None:
            # prompt chunks beside drafted rows: each group through its own C op, so a prompt's
            # tokens take gdn_rows' arithmetic whatever shares the step (as without drafts)
            state = (self.w.conv, pools.conv[self.layer], pools.recurrent[self.layer])
            scratch = (pools.conv_scratch[self.layer], pools.recurrent_scratch[self.layer])
            dec_in = (grp.slot_ids, grp.cu_seqlens, *scratch)
            o_dec = cpu_ops.gdn_verify(proj[: grp.tok_end], *state, *dec_in, *self.c_consts)
            o_pre = cpu_ops.gdn_rows(proj[pre.tok_start :], *batch.prefill_gdn_rows(), *state, *self.c_consts)
            return self.all_reduce(self.w.w_out(_pick(torch.cat([o_dec, o_pre]), rows)))
        if fused and batch.prefill is None and (grp.max_row_tokens == 1 or f32_state):
            state = (self.w.conv, pools.conv[self.layer], pools.recurrent[self.layer], grp.slot_ids)
            consts = self.c_consts
            if grp.max_row_tokens == 1:  # the steps below, fused
                o = cpu_ops.gdn_decode(proj, *state, *consts)
            else:  # speculative rows: states kept for rollback
                scratch = (pools.conv_scratch[self.layer], pools.recurrent_scratch[self.layer])
                o = cpu_ops.gdn_verify(proj, *state, grp.cu_seqlens, *scratch, *consts)
            return self.all_reduce(self.w.w_out(_pick(o, rows)))
        qkv, z, b, a = proj.split([self.conv_dim, self.value_dim, self.hv, self.hv], dim=-1)

        mixed = _per_group(batch, qkv, partial(self._conv, pools))
        qk, v = mixed.split([2 * self.key_dim, self.value_dim], dim=-1)
        # l2norm(x) == rms_norm(x, eps/dk) / sqrt(dk); q also takes the dk^-0.5 attention scale
        qk = F.rms_norm(qk.reshape(T, 2 * self.hk, self.dk).float(), (self.dk,), None, 1e-6 / self.dk) * self.qk_scale
        q, k = qk[:, : self.hk], qk[:, self.hk :]
        v = v.reshape(T, self.hv, self.dv)
        beta = b.sigmoid().float()  # in the model dtype, as transformers does
        g = self.neg_A * F.softplus(a.float() + self.dt_bias)
        o = _per_group(batch, (q, k, v, g, beta), partial(self._delta_rule, pools))
        o, z = _pick(o, rows), _pick(z.reshape(T, self.hv, self.dv), rows)
        o = gated_rms_norm(o, z, self.w.norm, self.eps)
        return self.all_reduce(self.w.w_out(o.reshape(o.shape[0], -1)))


class Attention:
    def __init__(
        self,
        w: AttentionWeights,
        n_heads: int,
        n_kv: int,
        hd: int,
        eps: float,
        all_reduce: AllReduce,
        invariant: bool = False,
    ):
        """invariant (--batch-invariant): prefill tokens too go through the C decode op, one token
        at a time in order (on CUDA: each a one-token row of the paged kernel), so each token's
        arithmetic is a decode step's whatever its chunk."""
        self.w, self.h, self.kvh, self.hd, self.eps = w, n_heads, n_kv, hd, eps
        self.invariant = invariant
        self.all_reduce = all_reduce
        self.scale = hd**-0.5
        # per-head (1 + w) of q_norm for query heads and k_norm for key heads
        self.qk_norm = torch.cat(
            [(1.0 + w.q_norm.float()).expand(n_heads, hd), (1.0 + w.k_norm.float()).expand(n_kv, hd)]
        )

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, kv_pool: torch.Tensor, cos, sin, rows=None):
        """rows: only these tokens' outputs are wanted (every token's k, v still goes to its page)."""
        qkv = self.w.w_qkv(x)  # rows [q | k | gate | v] (reordered by the loader)
        dec = batch.decode
        fused = not x.is_cuda and kv_pool.dtype == x.dtype and cpu_ops.available(x.dtype)
        if fused and batch.prefill is not None and self.invariant:
            # every token through the C op, one at a time in order: each a decode step's arithmetic
            tables, lens, starts = batch.step_token_rows()
            o = self._c_op(qkv, cos, sin, kv_pool, batch.slot_mapping, tables, lens, starts)
        elif fused and dec is not None:
            # the decode rows through the C op (rows with drafts token by token, in order); in a
            # mixed step the prompt chunks after them through the path below (gathering the
            # decode rows' pages for SDPA cost several times the op)
            n = dec.tok_end
            if dec.max_row_tokens > 1:
                (tables, lens), starts = batch.decode_token_rows(), dec.cu_seqlens
            else:
                tables, lens, starts = dec.block_tables, dec.seq_lens, None
            o = self._c_op(qkv[:n], cos[:n], sin[:n], kv_pool, batch.slot_mapping[:n], tables, lens, starts)
            if batch.prefill is not None:
                o = torch.cat([o, self._attend(qkv[n:], batch, kv_pool, cos[n:], sin[n:], n)])
        else:
            # CUDA, batch-invariant: a step with prompt or drafted tokens runs every token as a
            # decode row of the paged kernel (a plain decode step already does)
            steps = batch.prefill is not None or (dec is not None and dec.max_row_tokens > 1)
            each = self.invariant and x.is_cuda and steps
            o = self._attend(qkv, batch, kv_pool, cos, sin, 0, each)
        return self.all_reduce(self.w.w_o(_pick(o, rows)))

    def _c_op(self, qkv, cos, sin, kv_pool, slot_mapping, tables, lens, starts) -> torch.Tensor:
        """These tokens through the C attention op (kernels/cpu_ops.py `attn_decode`)."""
        h, kvh = self.h, self.kvh
        return cpu_ops.attn_decode(
            qkv, self.qk_norm, self.eps, cos, sin, kv_pool, slot_mapping, tables, lens, h, kvh, self.scale, starts
        )

    def _attend(
        self, qkv: torch.Tensor, batch: ForwardBatch, kv_pool: torch.Tensor, cos, sin, skip: int, each: bool = False
    ):
        """Attention * sigmoid(gate) [T, H*hd] of the tokens qkv holds: the step's tokens from
        `skip` on (skip: the decode group's tokens, done apart; 0: every group here). each: every
        token of the step a one-token row over its own context (`ForwardBatch.step_token_rows`),
        so it attends exactly as a decode step's token would."""
        T = qkv.shape[0]
        nqk = (self.h + self.kvh) * self.hd
        qk, gate, v = qkv.split([nqk, self.h * self.hd, self.kvh * self.hd], dim=-1)
        qk = F.rms_norm(qk.reshape(T, self.h + self.kvh, self.hd).float(), (self.hd,), None, self.eps)
        qk = apply_rotary_((qk * self.qk_norm).to(qkv.dtype), cos, sin)
        q, k = qk[:, : self.h], qk[:, self.h :]
        store_kv(k, v.view(T, self.kvh, self.hd), kv_pool, batch.slot_mapping[skip:])

        def attend(grp, qg, kg, vg):
            if grp.fresh and not grp.decode and not qg.is_cuda and kv_pool.dtype == qg.dtype:  # no pages to read
                return causal_attention(qg, kg, vg, grp.cu_seqlens, self.scale)
            return paged_attention(
                qg, kv_pool, grp.cu_seqlens, grp.seq_lens, grp.block_tables, self.scale, max_len=grp.max_row_tokens
            )

        qkv_t = (q, k, v.view(T, self.kvh, self.hd))
        if each:
            tables, lens, _ = batch.step_token_rows()
            one_each = torch.arange(T + 1, device=q.device)  # every token a row of its own
            o = paged_attention(q, kv_pool, one_each, lens, tables, self.scale, max_len=1)
        elif skip:  # the prefill group alone
            assert batch.prefill is not None
            o = attend(batch.prefill, *qkv_t)
        else:
            o = _per_group(batch, qkv_t, attend)
        return o.reshape(T, -1) * torch.sigmoid(gate)


class MLP:
    def __init__(self, w: MLPWeights, all_reduce: AllReduce):
        self.w, self.all_reduce = w, all_reduce
        # packed weights on a CPU with the C ops (float32, or bfloat16 in batch-invariant mode): the
        # gate in one C pass, the one the one-call decode runs too (engine/model/fused_decode.py)
        self.fused = w.w_gate_up.kind == "packed"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dim() == 2:
            return self.all_reduce(self.w.w_down(cpu_ops.silu_mul(self.w.w_gate_up(x))))
        gate, up = self.w.w_gate_up(x).chunk(2, dim=-1)
        return self.all_reduce(self.w.w_down(F.silu(gate, inplace=True).mul_(up)))  # in place: no [T, I] temporaries

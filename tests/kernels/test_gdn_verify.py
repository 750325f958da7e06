"""The fused C op for speculative GDN rows (kernels/cpu_ops.py `gdn_verify`) against the naive
per-token loops (kernels/naive.py): rows of different lengths, a plain one-token row among
them, the output of every token, each slot's final state and the per-token states kept for
rollback. Needs the C compiler `make test` machines have."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_ops
from kernels.naive import naive_conv, naive_gdn
from tests.helpers.kernel_testing import assert_close, assert_unchanged, cu_seqlens

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _naive_row(proj, conv_w, conv0, rec0, neg_A, dt_bias, norm_w, hk, hv, dk, dv, eps):
    """One row of L tokens, token by token: (out [L, Hv*dv], conv states [L, D, Kc-1],
    recurrent states [L, Hv, dk, dv]) after each token."""
    D = conv_w.shape[0]
    outs, convs, recs = [], [], []
    conv, rec = conv0.float(), rec0
    for t in range(proj.shape[0]):
        qkv, z, b, a = proj[t : t + 1].float().split([D, hv * dv, hv, hv], dim=-1)
        y, conv = naive_conv(qkv, conv_w.float(), conv)
        q, k = y[:, : 2 * hk * dk].reshape(1, 2 * hk, dk).split(hk, dim=1)
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))  # L2 norm, eps 1e-6
        v = y[:, 2 * hk * dk :].reshape(1, hv, dv)
        g = neg_A * F.softplus(a + dt_bias)
        o, rec = naive_gdn(q, k, v, g, b.sigmoid(), rec, scale=dk**-0.5)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * norm_w.float()
        outs.append((o * F.silu(z.reshape(1, hv, dv))).reshape(1, -1))
        convs.append(conv)
        recs.append(rec)
    return torch.cat(outs), torch.stack(convs), torch.stack(recs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "lens,hk,hv,dk,dv",
    [([2], 2, 4, 32, 32), ([4, 1, 3], 4, 8, 16, 32), ([1, 2], 3, 3, 16, 48)],
    ids=["one-row-k1", "mixed-k3-hv2x", "plain-and-k1-hv1x"],
)
def test_gdn_verify_matches_naive_loops(dtype, lens, hk, hv, dk, dv):
    g = torch.Generator().manual_seed(0)
    D, kc, S, n1, eps = 2 * hk * dk + hv * dv, 4, 6, 4, 1e-6
    T, B = sum(lens), len(lens)
    proj = torch.randn(T, D + hv * dv + 2 * hv, generator=g).to(dtype)
    conv_w = (torch.randn(D, kc, generator=g) * 0.5).to(dtype)
    conv_pool = torch.randn(S, D, kc - 1, generator=g).to(dtype)
    rec_pool = torch.randn(S, hv, dk, dv, generator=g) * 0.1
    slots = torch.randperm(S, generator=g)[:B]
    neg_A = -torch.rand(hv, generator=g) * 2
    dt_bias = torch.randn(hv, generator=g)
    norm_w = (1 + 0.1 * torch.randn(dv, generator=g)).to(dtype)
    conv_scr = torch.full((S, n1, D, kc - 1), float("nan"), dtype=dtype)
    rec_scr = torch.full((S, n1, hv, dk, dv), float("nan"))
    conv0, rec0, conv_scr0 = conv_pool.clone(), rec_pool.clone(), conv_scr.clone()
    cu = cu_seqlens(lens)
    got = cpu_ops.gdn_verify(
        proj, conv_w, conv_pool, rec_pool, slots, cu, conv_scr, rec_scr, neg_A, dt_bias, norm_w, hk, hv, dk, dv, eps
    )
    tol = TOL[dtype]
    for b, (s, n) in enumerate(zip(slots.tolist(), lens)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        out, convs, recs = _naive_row(
            proj[rows], conv_w, conv0[s], rec0[s], neg_A, dt_bias, norm_w, hk, hv, dk, dv, eps
        )
        assert_close(f"row {b} out", got[rows].float(), out, tol)
        assert_close(f"row {b} final conv state", conv_pool[s].float(), convs[-1], tol)
        assert_close(f"row {b} final recurrent state", rec_pool[s], recs[-1], tol)
        for j in range(n - 1):
            assert_close(f"row {b} conv state after token {j}", conv_scr[b, j].float(), convs[j], tol)
            assert_close(f"row {b} recurrent state after token {j}", rec_scr[b, j], recs[j], tol)
        assert_unchanged(f"row {b} scratch past its last token", conv_scr[b, n - 1 :], conv_scr0[b, n - 1 :])
    idle = [s for s in range(S) if s not in slots.tolist()]
    assert_unchanged("slots of no row", conv_pool[idle], conv0[idle])
    assert_unchanged("recurrent slots of no row", rec_pool[idle], rec0[idle])

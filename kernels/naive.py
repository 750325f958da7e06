"""Naive per-token loops: the slowest, most obviously right statement of each recurrence.
Used only by tests, as the reference the vectorised PyTorch ops are checked against."""

from __future__ import annotations

import torch

__all__ = ["naive_gdn", "naive_conv"]


def naive_gdn(q, k, v, g, beta, initial_state=None, scale=None):
    """One sequence. q, k [L, Hk, dk] (normalised), v [L, Hv, dv], g, beta [L, Hv].
    Returns (o [L, Hv, dv] float32, final state [Hv, dk, dv] float32)."""
    L, hk, dk = q.shape
    hv, dv = v.shape[1:]
    scale = dk**-0.5 if scale is None else scale
    S = torch.zeros(hv, dk, dv, dtype=torch.float64) if initial_state is None else initial_state.double().clone()
    o = torch.zeros(L, hv, dv, dtype=torch.float64)
    for t in range(L):
        for h in range(hv):
            kh = h // (hv // hk)
            qt, kt = q[t, kh].double() * scale, k[t, kh].double()
            a, b = torch.exp(g[t, h].double()), beta[t, h].double()
            pred = a * (S[h].T @ kt)
            S[h] = a * S[h] + b * torch.outer(kt, v[t, h].double() - pred)
            o[t, h] = S[h].T @ qt
    return o.float(), S.float()


def naive_conv(x, weight, initial_state=None, activation=True):
    """One sequence. x [L, D], weight [D, Kc], initial_state [D, Kc-1].
    Returns (y [L, D] float32, final state [D, Kc-1])."""
    L, D = x.shape
    kc = weight.shape[1]
    hist = torch.zeros(D, kc - 1, dtype=torch.float64) if initial_state is None else initial_state.double().clone()
    y = torch.zeros(L, D, dtype=torch.float64)
    for t in range(L):
        window = torch.cat([hist, x[t].double()[:, None]], dim=1)
        acc = (window * weight.double()).sum(1)
        y[t] = acc * torch.sigmoid(acc) if activation else acc
        hist = window[:, 1:]
    return y.float(), hist.float()

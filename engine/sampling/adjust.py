"""The sampler's logit adjustments over a call's positions: logit_bias, then the min_tokens ban of
the stop and EOS ids, then the repetition / presence / frequency penalties from the token-count
tables (engine/sampling/penalties.py) (vLLM's order: docs/api.md, "Sampling applies, in order"),
planned on the host into the call's HostPack and applied on the device.

Rows with drafts are adjusted at every position they score: draft position d is verified as if
the row's drafts 0 .. d-1 had already been emitted, which they have whenever that position's
draw counts. So position d's bias applies there, its ban while num_output + d < min_tokens, and
its penalties read a scratch table row: the request's row copied, plus its drafts 0 .. d-1
recorded by the same `record` as emitted tokens, so the penalty arithmetic is the one every row
takes (the same values as without drafts, bit for bit). After the draws, the request's row
counts the tokens the row emits (its leading drafts that the draws equal, and the draw after
them), found on the device from the ids and the drafts: no host read between. The scratch rows
go back to the table's free list when the call ends (`release`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.sampling.pack import HostPack, Sections
from engine.sampling.penalties import TokenCounts


@dataclass
class Adjust:
    """The host's plan of a call's adjustments: which rows are penalized, which sections exist."""

    pen: list[int]  # index in rows of each penalized row
    rep: bool = False
    pf: bool = False
    built: bool = False
    bias: bool = False
    ban: bool = False
    depth: int = 0  # the most drafts a penalized row carries (0: the penalties' positions are pen.at)
    scratch: list[int] = field(default_factory=list)  # table rows lent to this call's draft positions


def banned(r) -> int:
    """How many of a row's positions are under its min_tokens (the ban applies there)."""
    return max(0, min(r.num_draft + 1, r.params.min_tokens - r.num_output))


def plan(counts: TokenCounts | None, pack: HostPack, rows, pos: list[int], v: int, eos: tuple[int, ...]) -> Adjust:
    """Sections of a call's adjustments for `rows` (row i's positions pos[i] .. pos[i] + num_draft
    of the call's logits); counts: the sampler's tables, where a row is penalized; eos: the ids the
    min_tokens ban holds back besides the stop ids."""
    a = Adjust([i for i, r in enumerate(rows) if r.params.penalized])
    if a.pen:
        assert counts is not None
        pen = [rows[i] for i in a.pen]
        got = counts.rows([r.request_id for r in pen], [r.history for r in pen], pack, [r.num_draft for r in pen])
        a.built = "counts.rows" in pack
        pack.ints("pen.rows", got)
        pack.ints("pen.at", [pos[i] for i in a.pen])
        a.depth = max(r.num_draft for r in pen)
        reps = [1] * len(pen)
        if a.depth:
            reps = [r.num_draft + 1 for r in pen]
            _plan_drafts(a, counts, pack, pen, got, [pos[i] for i in a.pen])
        params = [r.params for r in pen]
        if any(p.repetition_penalty != 1.0 for p in params):
            a.rep = True
            pack.floats("pen.rep", [p.repetition_penalty for p, n in zip(params, reps) for _ in range(n)])
        if any(p.presence_penalty or p.frequency_penalty for p in params):
            a.pf = True
            pf = [(p.presence_penalty, p.frequency_penalty) for p, n in zip(params, reps) for _ in range(n)]
            pack.floats("pen.pf", [x for pair in pf for x in pair])
    bias_at, bias_tok, bias_val, ban_at, ban_tok = [], [], [], [], []
    for i, r in enumerate(rows):
        p = r.params
        if p.logit_bias:
            for d in range(r.num_draft + 1):
                for t, b in p.logit_bias:
                    if t < v:
                        bias_at.append(pos[i] + d)
                        bias_tok.append(t)
                        bias_val.append(b)
        n = banned(r)
        if n:
            ids = [t for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)) if t < v]
            for d in range(n):
                ban_at += [pos[i] + d] * len(ids)
                ban_tok += ids
    if bias_at:
        a.bias = True
        pack.ints("bias.at", bias_at)
        pack.ints("bias.tok", bias_tok)
        pack.floats("bias.val", bias_val)
    if ban_at:
        a.ban = True
        pack.ints("ban.at", ban_at)
        pack.ints("ban.tok", ban_tok)
        pack.floats("ban.val", [float("-inf")] * len(ban_at))  # on the device: a graph copies no host value
    return a


def _plan_drafts(a: Adjust, counts: TokenCounts, pack: HostPack, pen, got: list[int], at: list[int]) -> None:
    """Sections for penalized rows with drafts: a scratch table row per draft position d >= 1
    (pen.src -> pen.dst), draft j recorded into the scratch rows of the positions after it
    (pen.s{j}.rows / .at into pen.drafts), each position's table row (pen.q / pen.qrows), and for
    the update after the draws each row's drafts padded to the depth (pen.dpad, -1 past its own)
    and the position of each emitted token it may keep (pen.dpos)."""
    ks = [r.num_draft for r in pen]
    a.scratch = counts.take(sum(ks))
    drafts: list[int] = []
    src: list[int] = []
    q: list[int] = []
    qrows: list[int] = []
    first: list[int] = []
    lent = iter(a.scratch)
    for r, row, p, k in zip(pen, got, at, ks):
        first.append(len(drafts))
        drafts += r.token_ids[len(r.token_ids) - k :] if k else []
        mine = [next(lent) for _ in range(k)]
        src += [row] * k
        q += range(p, p + k + 1)
        qrows += [row] + mine
    pack.ints("pen.src", src)
    pack.ints("pen.dst", a.scratch)
    pack.ints("pen.drafts", drafts)
    for j in range(a.depth):  # scratch row of position d (1-based in the row) holds drafts 0 .. d-1
        rows_j, at_j, s = [], [], 0
        for k, f in zip(ks, first):
            rows_j += a.scratch[s + j : s + k]
            at_j += [f + j] * max(0, k - j)
            s += k
        pack.ints(f"pen.s{j}.rows", rows_j)
        pack.ints(f"pen.s{j}.at", at_j)
    pack.ints("pen.q", q)
    pack.ints("pen.qrows", qrows)
    pad = a.depth
    pack.ints("pen.dpad", [t for k, f in zip(ks, first) for t in drafts[f : f + k] + [-1] * (pad - k)])
    pack.ints("pen.dpos", [p + min(d, k) for p, k in zip(at, ks) for d in range(pad + 1)])


def apply(x: torch.Tensor, a: Adjust, s: Sections, counts: TokenCounts | None) -> None:
    """In place on x [N, V], the call's logits: the bias and the ban, then (new tables loaded,
    draft positions' scratch rows filled) the penalties, as vLLM orders them."""
    if a.bias:
        x.index_put_((s["bias.at"], s["bias.tok"]), s["bias.val"], accumulate=True)
    if a.ban:
        x.index_put_((s["ban.at"], s["ban.tok"]), s["ban.val"])
    if a.pen:
        assert counts is not None
        if a.built:
            counts.load(s)
        q, qrows = (s["pen.at"], s["pen.rows"]) if not a.depth else (s["pen.q"], s["pen.qrows"])
        if a.depth:
            counts.copy(s["pen.src"], s["pen.dst"])
            for j in range(a.depth):
                counts.record(s[f"pen.s{j}.rows"], s["pen.drafts"], s[f"pen.s{j}.at"])
        rep = s["pen.rep"] if a.rep else None
        pf = s["pen.pf"].view(-1, 2) if a.pf else None
        counts.apply(x, q, qrows, rep, pf)


def record(a: Adjust, s: Sections, counts: TokenCounts, tokens: torch.Tensor) -> None:
    """On the device, after the draws (tokens [n], the call's ids): each penalized request's row
    counts what its row emits. Without drafts its one token; with drafts, for d = 0 .. depth, the
    id at position d where the drafts before it equal the ids at theirs."""
    if not a.depth:
        counts.record(s["pen.rows"], tokens, s["pen.at"])
        return
    d1 = a.depth + 1
    pos = s["pen.dpos"].view(-1, d1)
    ids = tokens[pos]
    same = ids[:, :-1] == s["pen.dpad"].view(-1, a.depth)  # draft d kept: the draw at d equals it
    keep = torch.cat([torch.ones_like(same[:, :1]), same.int().cumprod(1).bool()], 1)
    for d in range(d1):
        counts.record(s["pen.rows"], ids[:, d], None, keep[:, d])


def release(a: Adjust, counts: TokenCounts | None) -> None:
    """The call's scratch rows back to the table (the call has run)."""
    if a.scratch and counts is not None:
        counts.give(a.scratch)
        a.scratch = []

"""The kept set of top-p / min-p rows over a whole vocabulary without sorting it, and the draw
over it: the inverse CDF of the kept tokens' probabilities in id order at the row's uniform,
which is what the sorted path draws once a row's kept set may pass RACE_LIMIT columns
(engine/sampling/draw.py). Also the check that lets a head group skip its top-k of HEAD when no
head can hold its row's kept set, and the chunked logsumexp that check and the head read.

The kept set is that of the row sorted by probability (softmax(x / T), float32), ties to the
lower id, filtered in vLLM's order: min-p first (a token stays while its probability is at least
min_p times the largest), then top-p over what min-p keeps (a token stays while the probability
of the kept tokens ranked above it, summed in float64, is below top_p times their total; the
most likely always stays). A non-negative float32's bits order it as its value does, so the high 16 bits
of each probability name its bucket (16,257 of them, probabilities being at most 1): one
scatter_add of the probabilities (float64) per bucket, a running sum from the most likely bucket
and a searchsorted find the bucket where the mass reaches top_p; the buckets above it stay, the
ones below leave, and its own members (a few hundred to a few thousand tokens on a flat row of
151,936) are sorted by (probability descending, id) and cut by their running mass. On the CPU
the rows go through in chunks of about a million logits, so that each chunk's temporaries stay
in cache (16 x 151,936 in one piece took about twice as long); elsewhere in one piece (the
members' nonzero waits for the device once). Tokens of probability 0 are never drawn, kept or not.
With the CPU operators built, `draw` and `draw_flat` take the kept set and the draw from
kernels/cpu_ops.py top_p_draw (the same bits: `kept` and inverse_cdf are its reference)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from engine.sampling.filters import inverse_cdf
from kernels import cpu_ops

TOP = (0x3F800000 >> 16) + 1  # buckets: the high 16 bits of a float32 probability (<= 1)
CHUNK_ELEMENTS = 1 << 20  # on the CPU, rows go through in chunks of about this many logits (cache-sized)


def probabilities(x: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """x [N, V] logits, temperature float32 [N] (> 0) -> float32 [N, V]: softmax(x / T) over each
    row (one row's values do not depend on the others')."""
    return torch.softmax(x.float() / temperature[:, None], dim=-1)


def logsumexp(x: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """float32 [N]: torch.logsumexp(x / T) over each row of x [N, V], the same values (a row's
    reduction does not depend on the others'), in chunks on the CPU: about twice as fast there
    at 16 x 151,936, whose temporaries a whole-batch call takes from fresh memory."""
    return torch.cat([torch.logsumexp(a / t[:, None], dim=-1) for a, t in _chunks(x, temperature)])


def head_cannot_hold(
    x: torch.Tensor,
    log_total: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    head: int,
) -> torch.Tensor:
    """bool [N]: rows with top-p alone whose `head` most likely tokens surely miss top_p's mass,
    so that the check of engine/sampling/filters.py head_suffices would fail (`cannot_hold`).
    log_total [N]: logsumexp(x / T)."""
    return cannot_hold(torch.exp(x.amax(-1) / temperature - log_total), top_p, min_p, head)


def cannot_hold(largest: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, head: int) -> torch.Tensor:
    """bool [N]: `head_cannot_hold` from each row's largest probability [N] (head times it is below
    top_p, with room for rounding: a largest found another way, within float32's rounding of the
    softmax, gives the same answer wherever head_suffices could hold the row)."""
    return (min_p <= 0) & (top_p < 1.0) & (largest * head < top_p * (1 - 1e-3))


def draw_flat(
    x: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, u: torch.Tensor, head: int
) -> torch.Tensor | None:
    """On the CPU with the operators built: `draw`'s tokens when no row's `head` most likely
    tokens can hold its kept set (`cannot_hold` on the largest probability of the softmax the
    draw takes, so that no logsumexp and no top-k are spent on flat rows), else None (as soon as
    a chunk holds such a row)."""
    if not bool(((min_p <= 0) & (top_p < 1.0)).all()):
        return None
    picks = []
    for a, t, p, m, v in _chunks(x, temperature, top_p, min_p, u):
        tokens, _, largest = cpu_ops.top_p_draw(probabilities(a, t), p, m, v)
        if not bool(cannot_hold(largest, p, m, head).all()):
            return None
        picks.append(tokens)
    return torch.cat(picks)


def native(x: torch.Tensor) -> bool:
    """Whether `draw` and `draw_flat` run kernels/cpu_ops.py top_p_draw for x's rows."""
    return x.device.type == "cpu" and cpu_ops.available()


def draw(
    x: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """int64 [N]: each row's token by the inverse CDF of its kept probabilities in id order at u
    float32 [N] in [0, 1) (engine/sampling/filters.py inverse_cdf); arguments as `kept`. On the
    CPU with the operators built, the kept set and the draw are kernels/cpu_ops.py top_p_draw's
    (the same tokens, `kept` and inverse_cdf its reference), after the softmax of each chunk."""
    chunks = _chunks(x, temperature, top_p, min_p, u)
    if native(x):
        return torch.cat([cpu_ops.top_p_draw(probabilities(a, t), p, m, v)[0] for a, t, p, m, v in chunks])
    return torch.cat([inverse_cdf(kept(*a), b) for *a, b in chunks])


def kept(x: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """x [N, V] logits; temperature (> 0), top_p (in (0, 1]), min_p float32 [N] -> float32 [N, V]:
    the probabilities of the kept tokens in id order (not renormalised), 0 elsewhere."""
    if x.device.type == "cpu" and x.shape[0] * x.shape[-1] > CHUNK_ELEMENTS:
        return torch.cat([kept(*a) for a in _chunks(x, temperature, top_p, min_p)])
    p = probabilities(x, temperature)
    n, dev = p.shape[0], p.device
    # min-p first (vLLM's order): tokens under min_p times the largest leave, and top-p counts
    # its share of the mass they leave (top_p times their total), not of the whole row's
    floor = (min_p * p.amax(-1)).view(torch.int32)[:, None]
    any_min = bool((min_p > 0).any())  # one read: rows without min-p skip its pass
    if any_min:
        p.mul_(p.view(torch.int32) >= floor)
    bits, wide = p.view(torch.int32), p.double()
    bucket = (bits >> 16).clamp_(0, TOP - 1)  # clamped: a NaN row (every logit -inf) stays in range
    mass = torch.zeros(n, TOP, dtype=torch.float64, device=dev).scatter_add_(1, bucket.long(), wide)
    mass = mass.flip(-1)  # the most likely bucket first
    reach = mass.cumsum(-1)
    # top-p's total: min-p's tokens summed bucket by bucket from the top (top_p_draw's order), or the softmax's 1
    share = torch.where(min_p > 0, reach[:, -1], 1.0) if any_min else 1.0
    tp = torch.where(top_p < 1.0, top_p.double() * share, float("inf"))[:, None]  # top_p 1: no cut
    j = torch.searchsorted(reach, tp)  # the bucket where the mass from the top reaches top_p (TOP: none)
    at = j.clamp(max=TOP - 1)
    above = reach.gather(1, at) - mass.gather(1, at)  # the mass of the buckets above it
    b = torch.where(j < TOP, TOP - 1 - j, -1).to(torch.int32)  # that bucket's high bits (-1: keep all)
    # its members in order (probability descending, then id), their mass from `above` (their own
    # running sum exact, in units of their mantissa: one bucket's members share their exponent)
    rows, cols = (bucket == b).nonzero(as_tuple=True)
    mine = p[rows, cols]
    shift = max(p.shape[-1] - 1, 1).bit_length()
    key = (rows << (31 + shift)) | ((0x7FFFFFFF - mine.view(torch.int32)).long() << shift) | cols
    order = torch.argsort(key)
    rows, cols, mine = rows[order], cols[order], mine[order]
    counts = torch.bincount(rows, minlength=n)
    cum = _exclusive_sums(mine)
    start = (counts.cumsum(0) - counts).clamp(max=max(rows.shape[0] - 1, 0))
    before = above[rows, 0] + (cum - (cum[start] if rows.shape[0] else cum)[rows]).double() * _unit(mine)
    gone = before >= tp[rows, 0]
    # the buckets below b leave (and the tokens under min-p's floor, already 0)
    least = torch.maximum(b.clamp(min=0) << 16, floor)  # the bits of the least probability kept
    if p.device.type == "cpu":  # in place, a row at a time: masked_fill_ costs about 25 times as much here
        below = torch.where(least > 0, least - 1, 0).view(torch.float32)  # kept: p > below
        for row, v in zip(p, below[:, 0].tolist()):
            torch.nn.functional.threshold(row, v, 0.0, inplace=True)
    else:
        p.mul_(bits >= least)
    p[rows[gone], cols[gone]] = 0.0
    return p


def _exclusive_sums(p: torch.Tensor) -> torch.Tensor:
    """int64: the running sum before each of p (float32, >= 0) in units of `_unit`, all rows'
    members together (exact: a row's members share their exponent, so its own sums, the
    difference of two of these, are exact in float64 too)."""
    b = p.view(torch.int32)
    m = ((b & 0x7FFFFF) | torch.where(b >= 1 << 23, 1 << 23, 0)).long()  # the mantissa, its leading 1
    return m.cumsum(0) - m


def _unit(p: torch.Tensor) -> torch.Tensor:
    """float64: the value of a mantissa unit of each of p (float32, >= 0), 2^(exponent - 150)."""
    e = (p.view(torch.int32) >> 23).clamp(min=1)
    return ((e + 1023 - 150).long() << 52).view(torch.float64)


def _chunks(*rows: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
    """The arguments' rows (dim 0) in chunks of about CHUNK_ELEMENTS logits on the CPU (x first);
    one chunk elsewhere."""
    x = rows[0]
    step = max(1, CHUNK_ELEMENTS // x.shape[-1]) if x.device.type == "cpu" else x.shape[0]
    for i in range(0, x.shape[0], step):
        yield tuple(r[i : i + step] for r in rows)

"""Prefix sharing between requests in flight: a waiting request that shares a new prefix with a
running request still computing its prompt is held back a step, until that request's snapshot is
written, when the wait pays (`hold_point`). Decided afresh every step, so it cannot deadlock.
The rules: docs/prefix-caching.md, "Module notes"."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import islice

from engine.request import Request, Status


@dataclass(frozen=True)
class Hold:
    """A waiting request waits for `sharer`'s snapshot at `num_tokens`."""

    sharer: Request
    num_tokens: int


def shared_tokens(a: list[int], a_hashes: list[int], b: list[int], b_hashes: list[int], block_size: int) -> int:
    """How many leading tokens `a` and `b` have in common, using their chained page hashes for the
    full pages (equal hashes: equal tokens up to that page's end) and comparing the rest."""
    j = 0
    for x, y in zip(a_hashes, b_hashes):
        if x != y:
            break
        j += 1
    n = j * block_size
    end = min(len(a), len(b))
    while n < end and a[n] == b[n]:
        n += 1
    return n


def hold_point(
    req: Request,
    hit: int,
    limit: int,
    running: Iterable[Request],
    interval: int,
    block_size: int,
    hashes: Callable[[Request], list[int]],
    others: Sequence[Request] = (),
) -> Hold | None:
    """The running request whose coming snapshot `req` (cached hit: `hit` tokens; lookup limit:
    `limit`) should wait for, and the point, or None: admit it now (module docstring). `others`:
    the requests waiting behind it, which may skip the same tokens by waiting too."""
    todo, k = req.num_tokens - hit, req.params.prompt_logprobs  # what it computes if admitted now
    best: Hold | None = None
    for r in running:
        start, rlen = r.num_computed_tokens, len(r.prompt_token_ids)
        if r is req or r.received or r.status is not Status.RUNNING or start >= rlen:
            continue
        if k is not None and (r.params.prompt_logprobs is None or r.params.prompt_logprobs < k):
            continue
        n = shared_tokens(req.hash_prompt, hashes(req), r.hash_prompt, hashes(r), block_size)
        top = min(n - 1 if k is not None else n, limit)  # token q must match for its logprob entry
        # the furthest point it saves within what both share: its prompt's end, a grid multiple
        # or one of its own snapshot points (a message break, a branch)
        q = rlen if rlen <= top else max([top // interval * interval, *(x for x in r.snapshot_points if x <= top)])
        if q <= start or q <= hit or (best is not None and q <= best.num_tokens):
            continue
        best = Hold(r, q)
    if best is None:
        return None
    gain = best.num_tokens - hit
    if gain >= interval and 2 * gain >= todo:
        return best
    # a burst: each of those waiting with the same hit skips the same tokens, and they compute
    # together in the next step; the wait pays when what they skip together is at least the
    # tokens this one computes now (and one snapshot interval)
    need = max(todo, interval)
    skipped = gain * siblings(req, hit, best.num_tokens, others, block_size, hashes, need)
    return best if skipped >= need else None


SIBLINGS_LOOKED_AT = 32  # waiting requests compared with one being held (a bound on the step's cost)


def siblings(
    req: Request,
    hit: int,
    point: int,
    others: Sequence[Request],
    block_size: int,
    hashes: Callable[[Request], list[int]],
    need: int,
) -> int:
    """`req` and those of the first SIBLINGS_LOOKED_AT `others` that share its first `point`
    tokens (the same cached prefix: they gain what it gains by waiting for that point); stops
    counting once gain x count reaches `need`."""
    n, mine = 1, hashes(req)
    gain = point - hit
    for o in islice(others, SIBLINGS_LOOKED_AT):
        if gain * n >= need:
            break
        if o is req or o.params.prompt_logprobs != req.params.prompt_logprobs:
            continue
        if len(o.hash_prompt) < point:
            continue
        if shared_tokens(req.hash_prompt, mine, o.hash_prompt, hashes(o), block_size) >= point:
            n += 1
    return n

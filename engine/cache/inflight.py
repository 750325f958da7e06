"""Prefix sharing between requests in flight at the same time.

A waiting request resumes from a snapshot only once the step that writes it has run
(engine/cache/prefix.py), so requests that share a new prefix and arrive together would all
compute it. Instead, when a request is about to be admitted and a running request that is still
computing its prompt will save a snapshot at a point this request shares, beyond this request's
own cache hit, the waiting request is held back: it stays in the queue, keeps its place, and is
looked up again at the next step. Once the sharer's step has committed the snapshot, the lookup
finds it and the request is admitted from there. Of a burst sharing a new prefix, the first is
admitted, which makes it a sharer for the rest, so the first step computes the prefix once.

A hold is decided afresh at every step from the running batch alone, so nothing can wait on a
request that is gone: a sharer that finishes, is aborted, fails or is preempted leaves the running
batch, and a sharer that has passed the point no longer offers it; either way the next lookup
admits the request as usual (with the snapshot, if it was written). A held request does not block
the queue: requests behind it that share nothing are admitted past it.

A hold must pay for the step it waits (`hold_point`): the point is at least one snapshot interval
beyond the request's current hit, and the tokens it would skip are at least half of what it would
compute if admitted now (its tokens less the hit). A short shared prefix (a chat template's first
tokens) therefore never holds anything, and neither does a long prompt whose shared part is small
next to its own.

The point is chosen the way the sharer will save snapshots (`PrefixPlanner.plan_save` in
engine/scheduler/prefix_plan.py): a multiple of the interval past its computed tokens, or its
prompt's end, no further than the tokens both prompts share and the waiting request's lookup
limit. A request with prompt logprobs resumes only
from a snapshot that keeps their entries for its token at the point (`PromptLogprobs`), which the
sharer leaves only when it asks for prompt logprobs too, with at least as many alternatives, and
only for its own next token: so the point must lie strictly inside the shared tokens.

Only where snapshots are written: a request whose prompt state came from another node (a decode
node's, `Request.received`) never computes a prompt, so it is never a sharer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

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
) -> Hold | None:
    """The running request whose coming snapshot `req` (cached hit: `hit` tokens; lookup limit:
    `limit`) should wait for, and the point, or None: admit it now (module docstring)."""
    todo, k = req.num_tokens - hit, req.params.prompt_logprobs  # what it computes if admitted now
    best: Hold | None = None
    for r in running:
        start, rlen = r.num_computed_tokens, len(r.prompt_token_ids)
        if r is req or r.received or r.status is not Status.RUNNING or start >= rlen:
            continue
        if k is not None and (r.params.prompt_logprobs is None or r.params.prompt_logprobs < k):
            continue
        n = shared_tokens(req.prompt_token_ids, hashes(req), r.prompt_token_ids, hashes(r), block_size)
        top = min(n - 1 if k is not None else n, limit)  # token q must match for its logprob entry
        q = rlen if rlen <= top else top // interval * interval
        if q <= start or q <= hit or (best is not None and q <= best.num_tokens):
            continue
        best = Hold(r, q)
    if best is None or best.num_tokens - hit < interval or 2 * (best.num_tokens - hit) < todo:
        return None
    return best

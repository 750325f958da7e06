"""Per-request speculative draft depth: a pure policy over the request's `SpecDepth` record (an
average of accepted drafts moves the depth by one; under the draft cost it goes to 0 and probes
again with a growing wait). The scheduler replaces the record with what it returns
(docs/speculative.md, depth control)."""

from __future__ import annotations

from dataclasses import replace

from engine.config import SpeculativeConfig
from engine.request import SpecDepth
from engine.sampling_params import SamplingParams


def max_depth(params: SamplingParams, num_spec_tokens: int) -> int:
    """The most drafts a row of a request carries: k, or the request's own
    num_speculative_tokens below it; 0 for a request that does not speculate."""
    if not params.speculates:
        return 0
    cap = params.num_speculative_tokens
    return num_spec_tokens if cap is None else min(cap, num_spec_tokens)


def started(s: SpecDepth, params: SamplingParams, num_spec_tokens: int) -> SpecDepth:
    """The record of a request entering the batch (queued, or activated on a decode node): its
    cap, and its depth at the cap."""
    cap = max_depth(params, num_spec_tokens)
    return replace(s, depth=cap, cap=cap)


def _verified(s: SpecDepth, cfg: SpeculativeConfig, proposed: int, accepted: int) -> tuple[float, float, int]:
    """(acceptance, first-draft rate, depth) after verifying `proposed` drafts of which `accepted`
    held; depth 0: under the draft cost."""
    probe = s.probing
    # the text may have changed since the request stopped drafting: the probe alone counts
    w = 1.0 if probe else cfg.depth_ema
    a = (1 - w) * s.acceptance + w * accepted / proposed
    first = (1 - w) * s.first + w * (accepted > 0)
    if first < cfg.draft_cost:
        return a, first, 0
    depth = s.depth
    if a < cfg.depth_lower and depth > 1:
        depth -= 1
    elif a > cfg.depth_raise and depth < s.cap and not probe:
        depth += 1
    return a, first, depth


def after_verify(s: SpecDepth, cfg: SpeculativeConfig, proposed: int, accepted: int) -> SpecDepth:
    """The record after verifying `proposed` drafts of which `accepted` held."""
    a, first, depth = _verified(s, cfg, proposed, accepted)
    if first < cfg.draft_cost:
        gap = min(2 * s.gap, cfg.probe_max) if s.probing else cfg.probe_interval
        return SpecDepth(0, a, first, False, gap, gap, s.cap)
    # built field by field: dataclasses.replace costs 2.5x as much, once per row and step
    return SpecDepth(depth, a, first, False, s.gap, s.wait, s.cap)


def after_plain(s: SpecDepth) -> SpecDepth:
    """The record after a sampling step without drafts: at depth 0 (and allowed to draft), one
    step closer to the next probe, which starts at depth 1."""
    if s.depth or not s.cap:
        return s
    if s.wait - 1 <= 0:
        return SpecDepth(1, s.acceptance, s.first, True, s.gap, s.wait - 1, s.cap)
    return SpecDepth(0, s.acceptance, s.first, s.probing, s.gap, s.wait - 1, s.cap)


def depths_after(s: SpecDepth, cfg: SpeculativeConfig, num_drafts: int) -> tuple[int, ...]:
    """The depth after a step carrying `num_drafts` drafts, for each number accepted (one entry
    without drafts): `ScheduledRow.draft_depths`, which the MTP drafter reads ahead."""
    if not num_drafts:  # after_plain's depth, without its record
        return (s.depth if s.depth or not s.cap else int(s.wait - 1 <= 0),)
    return tuple(_verified(s, cfg, num_drafts, a)[2] for a in range(num_drafts + 1))

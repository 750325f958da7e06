"""The sampled positions of a call: their randomness (SplitMix64 per (seed, position) and per
(seed, position, token id); a row without a seed takes a seed from the sampler's generator for
the draw) and their draws, in groups by how a row draws: over torch.topk's candidates (top-k up
to TOPK_LIMIT), over the HEAD most likely tokens (top-p or min-p alone on a large vocabulary),
over the sorted row (larger top-k, small vocabularies, and head rows the head does not hold), or
over the whole row (temperature alone). The first two, and sorted rows of at most RACE_LIMIT
columns that may hold kept tokens, draw by the exponential race of engine/sampling/filters.py;
the others by one inverse-CDF uniform over the kept tokens in id order (a key for each of a
large vocabulary's tokens costs more than the sort on the CPU). On a vocabulary above
RACE_LIMIT, sorted rows without a top-k (and, on the CPU, a head group whose heads are all too
flat to hold their kept sets) find their kept set without the sort (engine/sampling/cut.py).
The host plans the groups into the call's HostPack; the device draws from the uploaded sections."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling import cut
from engine.sampling.filters import candidate_probs, head_suffices, inverse_cdf, kept_log_total, race
from engine.sampling.pack import HostPack, Sections
from engine.sampling.rng import as_int64, seeded_uniforms, token_exponentials
from engine.sampling_params import SamplingParams
from kernels import cpu_ops

TOPK_LIMIT = 1024  # rows with a larger top_k sort the whole vocabulary
CPU_TOPK = 64  # the largest k the CPU's one-pass top-k takes (it keeps the k best sorted)
HEAD = 1024  # rows with top-p or min-p alone try the HEAD most likely tokens before a sort
RACE_LIMIT = 8192  # sorted rows with more columns that may hold kept tokens draw by one uniform
GROUPS = ("topk", "head", "sort", "plain")
FUSED = ("topk", "head")  # the groups one kernel draws on CUDA


def kind(top_k: int, p: SamplingParams, vocab: int, use_head: bool = True) -> str:
    """How a sampled row draws (top_k: 0 or below the vocabulary size)."""
    if 0 < top_k <= TOPK_LIMIT:
        return "topk"
    if top_k:
        return "sort"
    if p.top_p < 1.0 or p.min_p:
        return "head" if use_head and vocab > HEAD else "sort"
    return "plain"


@dataclass
class DrawPlan:
    """What the host planned: the groups present (name -> index in `sampled` of each member, the
    member's top_k) and how many rows draw without a seed."""

    groups: dict[str, tuple[list[int], list[int]]]
    num_unseeded: int
    tag: str
    fused: dict[str, int]  # groups one Triton kernel draws (kernels/triton/sampling.py): members without a seed
    # groups with a member with both min-p and top-p: top-p divides by the mass min-p keeps of the whole row
    min_p_top_p: frozenset[str] = frozenset()


def plan(
    pack: HostPack,
    sampled: list[int],
    per: list[tuple[SamplingParams, int]],
    vocab: int,
    tag: str = "draw",
    use_head: bool = True,
    fused: bool = False,
) -> DrawPlan:
    """Sections for the positions `sampled` (their params and new-token index, in `per`):
    `tag`.seed / .ctr / .unseeded and per group .q (positions), .j (members), .k, .t, .p, .m
    (fused: the topk and head groups' own .seed, .ctr, .seeded instead of the shared ones).
    use_head False: top-p / min-p rows sort their whole row."""
    seeds = [as_int64(p.seed) if p.seed is not None else 0 for p, _ in per]
    groups: dict[str, tuple[list[int], list[int]]] = {}
    for j, (p, _) in enumerate(per):
        k = p.top_k if 0 < p.top_k < vocab else 0
        members, ks = groups.setdefault(kind(k, p, vocab, use_head), ([], []))
        members.append(j)
        ks.append(k)
    own = {n for n in groups if fused and n in FUSED}  # groups that draw in the kernel
    shared = [j for n, (members, _) in groups.items() if n not in own for j in members]
    unseeded = [j for j in shared if per[j][0].seed is None]
    if shared:
        pack.ints(f"{tag}.seed", seeds)
        pack.ints(f"{tag}.ctr", [i for _, i in per])
    if unseeded:
        pack.ints(f"{tag}.unseeded", unseeded)
    for name, (members, ks) in groups.items():
        g = [per[j][0] for j in members]
        if name in own:
            pack.ints(f"{tag}.{name}.seed", [seeds[j] for j in members])
            pack.ints(f"{tag}.{name}.ctr", [per[j][1] for j in members])
            pack.ints(f"{tag}.{name}.seeded", [p.seed is not None for p in g])
        pack.ints(f"{tag}.{name}.q", [sampled[j] for j in members])
        pack.ints(f"{tag}.{name}.j", members)
        pack.floats(f"{tag}.{name}.t", [p.temperature for p in g])
        if name != "plain":
            pack.ints(f"{tag}.{name}.k", ks)
            pack.floats(f"{tag}.{name}.p", [p.top_p for p in g])
            pack.floats(f"{tag}.{name}.m", [p.min_p for p in g])
    counts = {n: sum(per[j][0].seed is None for j in groups[n][0]) for n in own}
    with_min_p = frozenset(
        n for n, (members, _) in groups.items() if any(per[j][0].min_p and per[j][0].top_p < 1 for j in members)
    )
    return DrawPlan(groups, len(unseeded), tag, counts, with_min_p)


def draw(
    x: torch.Tensor, dp: DrawPlan, s: Sections, tokens: torch.Tensor, gen: torch.Generator, everything: bool
) -> torch.Tensor | None:
    """Draw every planned position of x [N, V] into tokens [N] (everything: the plan covers all N
    rows in order). Fused groups (CUDA) take their candidates from kernels/triton/topk.py (k <= TOPK_SMALL) or
    torch.topk, and one kernel each. Returns bool [H] of the head group's members, in order: whether the head
    held every token the filters keep (where it did not, that row's token is to be drawn again
    with `plan` / `draw` as a "sort" row), or None without a head group."""
    dev, tag = x.device, dp.tag
    seeds = None
    held = None
    for name in GROUPS:
        if name not in dp.groups:
            continue
        members, ks = dp.groups[name]
        whole = everything and len(members) == x.shape[0]  # then the members are rows 0 .. N-1 in order
        q = s[f"{tag}.{name}.q"]
        xs = x if whole else x[q]
        t = s[f"{tag}.{name}.t"]
        if name in dp.fused:  # one kernel: filters, keys, race, store (and the head check)
            from kernels.triton.sampling import draw_triton
            from kernels.triton.topk import TOPK_SMALL, topk_triton

            k = HEAD if name == "head" else max(ks)
            # small k: two launches of ours (ties to the lower id) where torch.topk takes about 17
            vals, ids = topk_triton(xs, k) if k <= TOPK_SMALL else torch.topk(xs, k, dim=-1)
            total = _log_total(xs, t, s[f"{tag}.{name}.m"], name in dp.min_p_top_p) if name == "head" else None
            ctr = s[f"{tag}.{name}.ctr"]
            rand = random_seeds(len(members), gen, dev) if dp.fused[name] else ctr
            p = [s[f"{tag}.{name}.{c}"] for c in ("k", "p", "m", "seed", "seeded")]
            got = draw_triton(vals, ids, t, p[0], p[1], p[2], p[3], ctr, p[4], rand, q, tokens, total)
            held = got if name == "head" else held
            continue
        if seeds is None:
            seeds = s[f"{tag}.seed"]
            if dp.num_unseeded:
                seeds = seeds.clone()
                seeds[s[f"{tag}.unseeded"]] = random_seeds(dp.num_unseeded, gen, dev)
        ctr = s[f"{tag}.ctr"]
        if len(members) != seeds.shape[0]:
            j = s[f"{tag}.{name}.j"]
            gs, gc = seeds[j], ctr[j]
        else:
            gs, gc = seeds, ctr
        if name == "plain":
            pick = inverse_cdf(torch.softmax(xs / t[:, None], -1), seeded_uniforms(gs, gc))
        else:
            top_k = s[f"{tag}.{name}.k"] if any(ks) else None
            top_p, min_p = s[f"{tag}.{name}.p"], s[f"{tag}.{name}.m"]
            # flat rows on the CPU: the operator's draw, unless a row's head may hold its kept set
            checked = name == "head" and cut.native(xs) and xs.shape[-1] > RACE_LIMIT
            pick = cut.draw_flat(xs, t, top_p, min_p, seeded_uniforms(gs, gc), HEAD) if checked else None
            log_total = cut.logsumexp(xs, t) if name == "head" and pick is None else None
            if pick is None and _unsorted(name, xs, top_k, log_total, t, top_p, min_p, checked):
                pick = cut.draw(xs, t, top_p, min_p, seeded_uniforms(gs, gc))  # the kept set without a sort
            if pick is not None:
                if whole:
                    tokens.copy_(pick)
                else:
                    tokens[q] = pick
                continue
            if name == "topk":
                vals, ids = _topk(xs, max(ks))
            elif name == "head":
                vals, ids = torch.topk(xs, HEAD, dim=-1)
                if name in dp.min_p_top_p:  # top-p over min-p's tokens: their total, not the row's
                    log_total = kept_log_total(xs, t, min_p)
                assert log_total is not None
                held = head_suffices(vals, log_total, t, top_p, min_p)
            else:
                vals, ids = torch.sort(xs, dim=-1, descending=True)
            probs = candidate_probs(vals, t, top_k, top_p, min_p, log_total)
            c = max(ks) if all(ks) else probs.shape[-1]  # the columns that can hold kept tokens
            if c > RACE_LIMIT:  # the kept tokens back in id order: one uniform, no key per token
                pick = inverse_cdf(torch.zeros_like(probs).scatter_(1, ids, probs), seeded_uniforms(gs, gc))
            else:
                probs, ids = probs[:, :c], ids[:, :c]
                pick = ids.gather(1, race(probs, token_exponentials(gs, gc, ids))[:, None])[:, 0]
        if whole:
            tokens.copy_(pick)
        else:
            tokens[q] = pick
    return held


def _log_total(x: torch.Tensor, t: torch.Tensor, min_p: torch.Tensor, both: bool) -> torch.Tensor:
    """A head group's whole-row total for top-p: over min-p's tokens where a member has both
    (without top-p the total only scales what the draw renormalizes; without min-p it is the
    row's logsumexp either way)."""
    return kept_log_total(x, t, min_p) if both else cut.logsumexp(x, t)


def _unsorted(
    name: str,
    x: torch.Tensor,
    top_k: torch.Tensor | None,
    log_total: torch.Tensor | None,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    checked: bool = False,
) -> bool:
    """Whether a group draws from the kept set of engine/sampling/cut.py, found without sorting its
    rows, on a vocabulary above RACE_LIMIT (where the sorted draw is the inverse CDF over the kept
    tokens in id order too, so the tokens are the same): a sort group without a top-k, and on the
    CPU a head group none of whose heads can hold its kept set (flat rows, which would spend a
    top-k of HEAD and a second draw to find that out; checked: cut.draw_flat found one that may)."""
    if x.shape[-1] <= RACE_LIMIT:
        return False
    if name == "sort":
        return top_k is None
    return (
        not checked
        and name == "head"
        and x.device.type == "cpu"
        and log_total is not None
        and bool(cut.head_cannot_hold(x, log_total, temperature, top_p, min_p, HEAD).all())
    )


def _topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The topk group's candidates: on the CPU for k <= CPU_TOPK one pass of the C operator (ties
    to the lower id, as on CUDA; 1.1 ms against torch.topk's 4.8 ms at 64 x 151,936 and k = 20,
    docs/benchmarks.md), else torch.topk."""
    if x.device.type == "cpu" and k <= CPU_TOPK and x.stride(-1) == 1 and cpu_ops.available(x.dtype):
        return cpu_ops.topk(x, k)
    return torch.topk(x, k, dim=-1)


def random_seeds(n: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """int64 [n]: seeds from the sampler's generator for rows drawn without their own."""
    return torch.randint(-(1 << 63), (1 << 63) - 1, (n,), generator=gen, device=device, dtype=torch.int64)

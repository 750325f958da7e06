"""Transfer plans, pure: which bytes of a source rank's pools go to which bytes of a destination
rank's for one request, re-sharding TP a -> b without a staging copy (templates per rank pair,
expanded by block ids and coalesced; cached pages skipped). docs/transfer.md, docs/DESIGN.md §4."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple

import msgspec
import numpy as np
import numpy.typing as npt

from engine.cache.spec import PagedAttentionSpec
from transfer.errors import PlanError
from transfer.schema import KINDS, PAGED_KINDS, ModelDigest, RankSchema, TensorDesc

Ids = npt.NDArray[np.int64]  # block ids, byte offsets and lengths as numpy arrays


class Template(NamedTuple):
    """A contiguous piece of page 0, as byte offsets from the region start; page p's piece is
    p * page_stride further (on each side, with that side's page stride)."""

    src_off: int
    dst_off: int
    length: int


# The one cast a plan declares: (kind, source dtype, destination dtype). A float32 recurrent state
# feeding a bfloat16 one is rounded once by the sender into a staging region of the destination's
# dtype, and written from there; the reverse cannot restore the float32 bits and is refused.
CASTS: frozenset[tuple[str, str, str]] = frozenset({("gdn_recurrent", "float32", "bfloat16")})
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def castable(kind: str, src_dtype: str, dst_dtype: str) -> bool:
    return (kind, src_dtype, dst_dtype) in CASTS


def digest_bridged(src: ModelDigest, dst: ModelDigest) -> bool:
    """The digests are equal, or differ only in a recurrent dtype the plan casts."""
    if src == dst:
        return True
    return castable("gdn_recurrent", src.recurrent_dtype, dst.recurrent_dtype) and src == msgspec.structs.replace(
        dst, recurrent_dtype=src.recurrent_dtype
    )


def staged(s: TensorDesc, dtype: str) -> TensorDesc:
    """The layout of the staging region the sender casts `s`'s pool into: the same shape, the
    same page count, `dtype`'s item size (its address is the sender's to fill in)."""
    size = _ITEMSIZE[dtype]
    return msgspec.structs.replace(
        s,
        dtype=dtype,
        itemsize=size,
        page_stride=s.page_stride // s.itemsize * size,
        head_stride=s.head_stride // s.itemsize * size,
        nbytes=s.nbytes // s.itemsize * size,
        base_addr=0,
        region=f"{s.region}.{dtype}",
    )


class RegionPair(NamedTuple):
    """The templates of one layer and kind for one (source rank, destination rank) pair.

    `cast`: "" when the bytes move as they lie; else the dtype the sender casts the source pool's
    pages into (a staging region laid out as `src`, which then describes the staging region)."""

    layer: int
    kind: str
    src: TensorDesc
    dst: TensorDesc
    templates: tuple[Template, ...]
    cast: str = ""

    @property
    def paged(self) -> bool:
        return self.kind in PAGED_KINDS


def src_key(p: RegionPair) -> tuple[int, str]:
    """The source region a pair reads: the pool (layer, kind), or its staging region of `p.cast`."""
    return (p.layer, f"{p.kind}.{p.cast}" if p.cast else p.kind)


class Range(NamedTuple):
    """Bytes [src_off, src_off + length) of the source region go to [dst_off, ...) of the destination's."""

    layer: int
    kind: str
    src_off: int
    dst_off: int
    length: int


def _coalesce_templates(pieces: list[Template]) -> tuple[Template, ...]:
    out: list[Template] = []
    for p in sorted(pieces):
        if out and out[-1].src_off + out[-1].length == p.src_off and out[-1].dst_off + out[-1].length == p.dst_off:
            out[-1] = Template(out[-1].src_off, out[-1].dst_off, out[-1].length + p.length)
        else:
            out.append(p)
    return tuple(out)


def _kv_templates(s: TensorDesc, d: TensorDesc) -> list[Template]:
    """Per head: its K and V of one block is one contiguous run (head-major pool), and the
    head's next block follows it, so consecutive blocks coalesce."""
    if s.axes != PagedAttentionSpec.storage_axes:
        raise PlanError(
            f"paged_kv layer {s.layer}: pool axes {s.axes}, this plan knows {PagedAttentionSpec.storage_axes}"
        )
    piece = int(np.prod(s.local_shape[2:])) * s.itemsize  # (2, bs, hd)
    if piece != s.page_stride or piece != d.page_stride:
        raise PlanError(
            f"paged_kv layer {s.layer}: a head's block is {piece} B, page strides {s.page_stride} / {d.page_stride}"
        )
    out = []
    for j, h in enumerate(d.heads):
        if h not in s.heads or s.replica != d.tp_rank % s.replication:
            continue  # not held here, or another source replica of this head serves d
        out.append(Template(s.heads.index(h) * s.head_stride, j * d.head_stride, piece))
    return out


def _conv_templates(s: TensorDesc, d: TensorDesc) -> list[Template]:
    """Per segment: the overlap of the two ranks' channel pieces (DS layout: channels are rows)."""
    row = s.local_shape[2] * s.itemsize  # Kc - 1 columns of one channel
    dseg = {g.name: g for g in d.segments}
    out = []
    for a in s.segments:
        b = dseg[a.name]
        lo, hi = max(a.rank_start, b.rank_start), min(a.rank_start + a.local_width, b.rank_start + b.local_width)
        if lo < hi:
            out.append(
                Template(
                    (a.local_offset + lo - a.rank_start) * row,
                    (b.local_offset + lo - b.rank_start) * row,
                    (hi - lo) * row,
                )
            )
    return out


def _head_templates(s: TensorDesc, d: TensorDesc) -> list[Template]:
    """Recurrent state: one (dk, dv) block per value head, head-major within a slot."""
    head = int(np.prod(s.local_shape[2:])) * s.itemsize
    pos = {h: i for i, h in enumerate(s.heads)}
    return [Template(pos[h] * s.head_stride, j * d.head_stride, head) for j, h in enumerate(d.heads) if h in pos]


_TEMPLATES = {
    "paged_kv": _kv_templates,
    "mtp_kv": _kv_templates,  # the MTP layer's KV: same layout, own pool, same block ids
    "gdn_conv": _conv_templates,
    "gdn_recurrent": _head_templates,
}


def pair_templates(src: RankSchema, dst: RankSchema) -> tuple[RegionPair, ...]:
    """What source rank `src.tp_rank` writes into destination rank `dst.tp_rank`, per page.

    Regions the pair does not share (e.g. KV heads another source replica serves) are left out,
    so an empty result means this source sends nothing to this destination.
    """
    if not digest_bridged(src.digest, dst.digest) or src.block_size != dst.block_size:
        raise PlanError("schemas differ in model digest or block size; run the handshake first")
    dst_t = {t.key: t for t in dst.tensors}
    out = []
    for s in src.tensors:
        d = dst_t[s.key]
        cast = d.dtype if s.dtype != d.dtype and castable(s.kind, s.dtype, d.dtype) else ""
        if cast:
            s = staged(s, cast)  # noqa: PLW2901 (the pair reads the staging region)
        if s.dtype != d.dtype or s.axes != d.axes:
            raise PlanError(f"{s.kind} layer {s.layer}: dtype/axes differ ({s.dtype} {s.axes} vs {d.dtype} {d.axes})")
        t = _coalesce_templates(_TEMPLATES[s.kind](s, d))
        if t:
            out.append(RegionPair(s.layer, s.kind, s, d, t, cast))
    out.sort(key=lambda p: (p.layer, KINDS.index(p.kind)))
    return tuple(out)


def check_ids(
    pairs: Sequence[RegionPair], src_blocks: Sequence[int], dst_blocks: Sequence[int], src_slot: int, dst_slot: int
) -> None:
    """Refuse ids that are out of range, duplicated, or unpaired."""
    if len(src_blocks) != len(dst_blocks):
        raise PlanError(f"{len(src_blocks)} source blocks but {len(dst_blocks)} destination blocks")
    for name, ids in (("source", src_blocks), ("destination", dst_blocks)):
        if len(set(ids)) != len(ids):
            raise PlanError(f"duplicate {name} block ids {sorted(ids)}")
    for p in pairs:
        if p.paged:
            for name, ids, desc in (("source", src_blocks, p.src), ("destination", dst_blocks, p.dst)):
                if len(ids) and (min(ids) < 0 or max(ids) >= desc.num_pages):
                    raise PlanError(f"{name} block ids {min(ids)}..{max(ids)} outside 0..{desc.num_pages - 1}")
        else:
            sides = (("source", src_slot, p.src), ("destination", dst_slot, p.dst))
            for name, slot, desc in sides[1:] if p.cast else sides:  # a cast reads the sender's staging slot
                if not 0 <= slot < desc.num_pages:
                    raise PlanError(f"{name} state slot {slot} outside 0..{desc.num_pages - 1}")


def block_order(src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> tuple[Ids, Ids]:
    """Block pairs sorted by source id: consecutive ids become adjacent, hence coalescible."""
    s = np.asarray(src_blocks, dtype=np.int64)
    d = np.asarray(dst_blocks, dtype=np.int64)
    order = np.argsort(s, kind="stable")
    return s[order], d[order]


def selected(
    pairs: Sequence[RegionPair], layers: Collection[int] | None = None, kinds: Collection[str] | None = None
) -> list[RegionPair]:
    return [p for p in pairs if (layers is None or p.layer in layers) and (kinds is None or p.kind in kinds)]


def expand_arrays(
    pairs: Sequence[RegionPair],
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    src_slot: int,
    dst_slot: int,
    stage_slot: int | None = None,
) -> tuple[Ids, Ids, Ids, Ids]:
    """(region index, src offset, dst offset, length) arrays, coalesced; region index into `pairs`.
    A cast pair reads staging slot `stage_slot` (None: `src_slot`, for the destination's view)."""
    check_ids(pairs, src_blocks, dst_blocks, src_slot, dst_slot)
    sb, db = block_order(src_blocks, dst_blocks)
    reg: list[Ids] = []
    so: list[Ids] = []
    do: list[Ids] = []
    ln: list[Ids] = []
    for i, p in enumerate(pairs):
        for t in p.templates:
            if p.paged:
                s = sb * p.src.page_stride + t.src_off
                d = db * p.dst.page_stride + t.dst_off
            else:
                slot = stage_slot if p.cast and stage_slot is not None else src_slot
                s = np.array([slot * p.src.page_stride + t.src_off], dtype=np.int64)
                d = np.array([dst_slot * p.dst.page_stride + t.dst_off], dtype=np.int64)
            reg.append(np.full(len(s), i, dtype=np.int64))
            so.append(s)
            do.append(d)
            ln.append(np.full(len(s), t.length, dtype=np.int64))
    if not reg:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z, z
    r, s, d, n = (np.concatenate(x) for x in (reg, so, do, ln))
    if len(r) == 0:
        return r, s, d, n
    start = np.ones(len(r), dtype=bool)
    start[1:] = (r[1:] != r[:-1]) | (s[1:] != s[:-1] + n[:-1]) | (d[1:] != d[:-1] + n[:-1])
    first = np.flatnonzero(start)
    return r[first], s[first], d[first], np.add.reduceat(n, first)


def skip_cached(
    src_blocks: Sequence[int], dst_blocks: Sequence[int], cached_blocks: int
) -> tuple[list[int], list[int]]:
    """The block pairs that move when the destination already holds the first `cached_blocks`
    pages (its prefix cache): the rest. The sender does not read the skipped pages, the receiver
    does not expect them; state slots always move."""
    if not 0 <= cached_blocks <= len(src_blocks):
        raise PlanError(f"{cached_blocks} cached blocks of a request of {len(src_blocks)} blocks")
    return list(src_blocks)[cached_blocks:], list(dst_blocks)[cached_blocks:]


def plan_nbytes(pairs: Sequence[RegionPair], num_blocks: int) -> int:
    """Bytes the ranges of `pairs` cover for a request of `num_blocks` blocks: what
    `expand_arrays` returns summed, without expanding (coalescing never changes the sum)."""
    return sum(t.length * (num_blocks if p.paged else 1) for p in pairs for t in p.templates)


def expand(
    pairs: Sequence[RegionPair], src_blocks: Sequence[int], dst_blocks: Sequence[int], src_slot: int, dst_slot: int
) -> list[Range]:
    reg, so, do, ln = expand_arrays(pairs, src_blocks, dst_blocks, src_slot, dst_slot)
    return [
        Range(pairs[r].layer, pairs[r].kind, s, d, n)
        for r, s, d, n in zip(reg.tolist(), so.tolist(), do.tolist(), ln.tolist())
    ]


def plan(
    src: RankSchema,
    dst: RankSchema,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    src_slot: int,
    dst_slot: int,
    layers: Collection[int] | None = None,
    kinds: Collection[str] | None = None,
    cached_blocks: int = 0,
) -> list[Range]:
    """The coalesced byte ranges source rank `src.tp_rank` writes into destination rank `dst.tp_rank`.

    `src_blocks[i]` holds the same tokens as `dst_blocks[i]`; `src_slot` / `dst_slot` are the
    request's GDN state slots. `layers` / `kinds` restrict the plan (streaming KV by layer);
    the first `cached_blocks` pairs are left out (`skip_cached`).
    """
    sb, db = skip_cached(src_blocks, dst_blocks, cached_blocks)
    return expand(selected(pair_templates(src, dst), layers, kinds), sb, db, src_slot, dst_slot)


def sources_for(src_schemas: Sequence[RankSchema], dst: RankSchema) -> list[int]:
    """Source ranks that send something to `dst`: the notifications a destination rank waits for."""
    return [s.tp_rank for s in src_schemas if pair_templates(s, dst)]

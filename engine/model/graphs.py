"""CUDA graphs for plain decode steps (one token per row, no prefill rows, no drafts, TP 1): the
step's inputs are copied into buffers the graph owns, one graph per batch size (or bucket). A
decode step the graphs take is staged by `stage` straight into its size's buffers: its ids,
positions, slots and its page tables (packed [rows, widest row]) written to pinned host memory,
then one upload; the graph itself spreads the packed tables into the [rows, max pages] tensor the
kernels read (`_Buffers.expand`). Each host-to-device copy, event or launch costs the host tens of
microseconds on the GPU hosts measured (docs/benchmarks.md, "CUDA (H100)"), so a staged step makes
one upload and reuses its events. A steady step (StepInput.steady: the last step's rows, a token
on) moves the last step's host buffer on in place (`_advance`; docs/engine.md, "The persistent
decode batch"). The first step of a size runs eagerly on those buffers (compiling every kernel
for their exact shapes and strides), the next one captures the graph and replays it from then on.
Any other step, and any size whose capture failed, runs eagerly. With `buckets` (CUDA), a step of n
rows runs in the graph of the smallest bucket of at least n, its other rows padding that write the
pools' padding slot and page (`CachePools.pad`); `capture_all` captures every bucket at start-up.
--no-cuda-graphs (or PDSERVE_CUDA_GRAPHS=0) turns graphs off (docs/engine.md, "CUDA graphs"). On
the CPU (TP 1) the same staged steps run without a graph (`packed`): written where the forward
reads them, the page tables read as packed."""

from __future__ import annotations

import bisect
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.cache.allocator import CachePools
from engine.model.batch import ForwardBatch, RowGroup

log = logging.getLogger("pdserve.engine")


def graphs_wanted(device: torch.device, tp: int, on: bool = True) -> bool:
    """on: the engine's --cuda-graphs (EngineConfig.cuda_graphs); PDSERVE_CUDA_GRAPHS=0 also turns them off."""
    return on and device.type == "cuda" and tp == 1 and os.environ.get("PDSERVE_CUDA_GRAPHS", "1") != "0"


# the staged fields of a decode step of n rows, in this order in one int64 buffer of STAGED * n
STAGED = ("input_ids", "slot_ids", "positions", "slot_mapping", "seq_lens")  # the last three move on together


# columns the packed page tables keep past the widest row's pages: the steps staged by
# `DecodeGraphs._advance` pack them again only when a row outgrows them (every SLACK_PAGES pages of
# the longest row), for 8 bytes a row and column more in the step's upload
SLACK_PAGES = 4


def _width_at(n: int) -> int:
    """Where a staged size of n rows keeps, in its flat buffers, the packed page tables' width
    (after the STAGED fields; the packed tables follow it)."""
    return len(STAGED) * n


def decode_buckets(max_rows: int) -> tuple[int, ...]:
    """The batch sizes the decode graphs are captured for, up to max_rows (which is one): 1, 2, 4,
    every 8 to 64, every 16 to 128, every 32 past: a step has at most 7, 15 or 31 padding rows, which
    cost little in a decode step bound by reading the weights."""
    sizes = [1, 2, 4, *range(8, 65, 8), *range(80, 129, 16), *range(160, max_rows, 32)]
    return tuple(sorted({b for b in sizes if b < max_rows} | {max_rows}))


def logits_bytes(buckets: Sequence[int], vocab: int) -> int:
    """What the graphs of these sizes keep between replays: each one's logits, [B, vocab] float32."""
    return 4 * vocab * sum(buckets)


def plain_decode(rows) -> bool:
    """Whether a step's rows (engine/step.py RowInput) are all plain decode rows as `stage` takes
    them: one token continuing its sequence, scoring it, no drafts, prompt logprobs or images."""
    return all(
        r.is_decode
        and len(r.token_ids) == 1
        and not r.num_draft
        and r.prompt_logprobs is None
        and (r.sample or r.want_logits)
        and r.mrope is None
        and not r.rope_delta
        for r in rows
    )


@dataclass
class _Buffers:
    """The inputs of a decode step of B rows, in tensors that outlive the step. For a staged size,
    `flat` holds the STAGED fields back to back (`batch`'s tensors are views of it), then the
    packed page tables' width w, then the tables packed [B, w]; `host` is its pinned twin, of
    which a step uploads the prefix it wrote. `expand` spreads the packed tables into
    `batch.decode.block_tables` [B, max pages], inside the graph."""

    batch: ForwardBatch
    flat: torch.Tensor | None = None
    host: torch.Tensor | None = None
    host_np: Any = None  # `host` seen by numpy, made with it
    pending: Any = None  # a CUDA event recorded after each upload from `host` (pinned on CUDA)
    stepped: bool = False  # a step has run on these buffers
    row_ids: torch.Tensor | None = None  # [B, 1]: 0 .. B-1, for `expand`
    # `DecodeGraphs._advance`: steps moved on since the last full write, and the rows by their
    # position's offset in a page at that write
    ahead: int = 0
    by_offset: dict[int, list[int]] = field(default_factory=dict)
    col_ids: torch.Tensor | None = None  # [max pages]: 0 .. max pages - 1
    size: int = 0  # B, for a staged size
    rows: int = 0  # the real rows of the last step staged here; the rest pad it

    @classmethod
    def staged(cls, n: int, width: int, device: torch.device, packed: bool = False) -> _Buffers:
        """Buffers for n plain decode rows: each row's one token is scored (logits_indices and
        cu_seqlens 0 .. n) and continues its slot's sequence (has_initial_state: a decode row has
        tokens in the cache), fixed here. packed (the CPU, no graph): `flat` is its own host
        buffer, and the batch reads the packed tables as they are ([B, w], set by `stage`)."""
        size = _width_at(n) + 1 + n * width
        arr = np.zeros(size, dtype=np.int64) if packed else None  # the CPU's: numpy's memory, no view made of a tensor
        flat = torch.from_numpy(arr) if arr is not None else torch.zeros(size, dtype=torch.int64, device=device)
        f = dict(zip(STAGED, flat[: _width_at(n)].view(len(STAGED), n)))
        steps = torch.arange(n + 1, dtype=torch.int64, device=device)
        group = RowGroup(
            tok_start=0,
            tok_end=n,
            cu_seqlens=steps,
            slot_ids=f["slot_ids"],
            has_initial_state=torch.ones(n, dtype=torch.bool, device=device),
            seq_lens=f["seq_lens"],
            block_tables=torch.zeros(n, 0 if packed else width, dtype=torch.int64, device=device),
            decode=True,
            max_row_tokens=1,
        )
        batch = ForwardBatch(
            input_ids=f["input_ids"],
            positions=f["positions"],
            slot_mapping=f["slot_mapping"],
            decode=group,
            prefill=None,
            logits_indices=steps[:n],
        )
        if arr is not None:
            return cls(batch, flat, flat, arr, size=n)
        pinned = device.type == "cuda"
        host = torch.zeros(flat.numel(), dtype=torch.int64, pin_memory=pinned)
        cols = torch.arange(width, dtype=torch.int64, device=device)
        event = torch.cuda.Event() if pinned else None
        return cls(batch, flat, host, host.numpy(), event, row_ids=steps[:n, None], col_ids=cols, size=n)

    def expand(self) -> None:
        """The packed page tables (w columns a row, w in the buffer) into the [B, max pages]
        tensor the kernels read: entry (r, c) from packed place r * w + c. Device ops of fixed
        shapes that read w on the device, so one graph replays them for any w; the columns past
        a row's w get other rows' pages, which the kernels never read (they stop at seq_lens)."""
        if self.flat is None:
            return
        dec = self.batch.decode
        assert dec is not None and self.row_ids is not None and self.col_ids is not None
        n, width = dec.block_tables.shape
        head = _width_at(n)
        at = self.row_ids * self.flat[head] + self.col_ids  # [B, max pages]: r * w + c
        at.clamp_(max=n * width - 1)
        torch.index_select(self.flat[head + 1 :], 0, at.view(-1), out=dec.block_tables.view(-1))

    @classmethod
    def like(cls, b: ForwardBatch, width: int) -> _Buffers:
        dec = b.decode
        assert dec is not None
        n = dec.num_rows
        tables = torch.zeros(n, width, dtype=dec.block_tables.dtype, device=dec.block_tables.device)
        group = RowGroup(
            tok_start=0,
            tok_end=n,
            cu_seqlens=torch.empty_like(dec.cu_seqlens),
            slot_ids=torch.empty_like(dec.slot_ids),
            has_initial_state=torch.empty_like(dec.has_initial_state),
            seq_lens=torch.empty_like(dec.seq_lens),
            block_tables=tables,
            decode=True,
            max_row_tokens=1,
        )
        made = ForwardBatch(
            input_ids=torch.empty_like(b.input_ids),
            positions=torch.empty_like(b.positions),
            slot_mapping=torch.empty_like(b.slot_mapping),
            decode=group,
            prefill=None,
            logits_indices=torch.empty_like(b.logits_indices),
        )
        return cls(made)

    def load(self, b: ForwardBatch) -> None:
        s, src = self.batch, b
        sd, bd = s.decode, src.decode
        assert sd is not None and bd is not None
        for dst, x in (
            (s.input_ids, src.input_ids),
            (s.positions, src.positions),
            (s.slot_mapping, src.slot_mapping),
            (s.logits_indices, src.logits_indices),
            (sd.cu_seqlens, bd.cu_seqlens),
            (sd.slot_ids, bd.slot_ids),
            (sd.has_initial_state, bd.has_initial_state),
            (sd.seq_lens, bd.seq_lens),
        ):
            dst.copy_(x, non_blocking=True)
        self.rows = bd.num_rows
        if self.flat is not None:  # a staged size's tables come from its packed ones (`expand`)
            n, w = bd.block_tables.shape
            head = _width_at(n)
            self.flat[head].fill_(w)
            self.flat[head + 1 : head + 1 + n * w].copy_(bd.block_tables.reshape(-1), non_blocking=True)
            return
        # columns past a row's pages are never read (the kernels stop at seq_lens)
        sd.block_tables[:, : bd.block_tables.shape[1]].copy_(bd.block_tables, non_blocking=True)


@dataclass
class _Graph:
    buffers: _Buffers
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None


class DecodeGraphs:
    def __init__(
        self,
        model,
        pools: CachePools,
        max_pages_per_row: int,
        capture: bool = True,
        packed: bool = False,
        buckets: Sequence[int] = (),
    ):
        """capture False: the buffers alone, every step run eagerly on them (what the CPU tests
        check: the copying, not the graph). packed (the CPU's own decode steps, no graph): a staged
        step is written where the forward reads it and its page tables are read packed, as they
        are (no upload, no spreading); a batch built the general way runs as it is. buckets
        (`decode_buckets`; the pools need their padding slot and page): the sizes steps are padded
        to; a step of more rows, or built the general way, runs eagerly. Empty: one size per batch
        size met."""
        self.model, self.pools, self.width, self.capture = model, pools, max_pages_per_row, capture and not packed
        self.packed = packed
        self.buckets = tuple(sorted(buckets))
        if self.buckets and pools.pad is None:
            raise ValueError("padded decode graphs need the pools' padding slot and page (Capacity.padding)")
        self.sizes: dict[int, _Graph] = {}
        self.failed: set[int] = set()
        self.pool: Any = None  # the graphs' shared memory pool (a handle)
        self.stream = torch.cuda.Stream() if capture else None
        self.replays = 0  # steps replayed from a graph
        self.covered = 0  # steps run on the buffers (replayed or eager)
        self.replayed = False  # the last `run` replayed a graph (its logits are the graph's)
        self.last_staged: int | None = None  # the size `stage` staged the last step in (None: built otherwise)

    def covers(self, b: ForwardBatch) -> bool:
        dec = b.decode
        return (
            b.prefill is None
            and b.rope_positions is None  # positions of a request with images: eager
            and dec is not None
            and dec.max_row_tokens == 1
            and dec.points is None
            and dec.num_tokens == dec.num_rows
            and b.logits_indices.numel() == dec.num_rows
            and dec.block_tables.shape[1] <= self.width
            and dec.num_rows not in self.failed
        )

    def size_for(self, n: int) -> int | None:
        """The staged size a step of n rows runs in: n, or with buckets the smallest of at least
        n (None past the largest)."""
        if not self.buckets:
            return n
        i = bisect.bisect_left(self.buckets, n)
        return self.buckets[i] if i < len(self.buckets) else None

    def stage(self, rows, tables, block_size: int, steady: bool = False) -> ForwardBatch | None:
        """A plain decode step's batch (`plain_decode(rows)`; tables: engine/block_tables.py) made
        in its size's buffers, which `run` then finds loaded; None where the graphs do not take
        the step (the worker builds it the general way). steady (StepInput.steady): the rows are
        the last step's, a token further on; where that step was staged here too, its host
        buffers are moved on in place (`_advance`)."""
        n = len(rows)
        size = self.size_for(n)
        staged, self.last_staged = self.last_staged, None
        if size is None or size in self.failed:
            return None
        g = self.sizes.get(size)
        if g is None:
            g = self.sizes[size] = _Graph(_Buffers.staged(size, self.width, self.model.embed.device, self.packed))
        elif g.buffers.flat is None:  # this size's buffers came from a general batch: loaded by `run`
            return None
        buf = g.buffers
        assert buf.host is not None and buf.flat is not None
        if buf.pending is not None:  # the last upload from these host buffers must be done
            buf.pending.synchronize()
        if steady and staged == size and buf.rows == n:
            end = self._advance(buf, rows, tables, block_size)
        else:
            end = self._write(buf, rows, tables, block_size)
        self.last_staged = size
        return self._loaded(buf, end)

    def _loaded(self, buf: _Buffers, end: int) -> ForwardBatch:
        """The staged batch once the host buffer's first `end` entries are where the forward reads
        them: uploaded (one copy), or on the CPU read in place with the packed tables."""
        assert buf.host is not None and buf.flat is not None and buf.batch.decode is not None
        if self.packed:  # written in place: the batch reads the packed tables
            head = _width_at(buf.size) + 1
            w = int(buf.host_np[head - 1])
            buf.batch.decode.block_tables = buf.flat[head : head + buf.size * w].view(buf.size, w)
            return buf.batch
        buf.flat[:end].copy_(buf.host[:end], non_blocking=True)  # the step's one upload
        if buf.pending is not None:
            buf.pending.record()
        return buf.batch

    def _write(self, buf: _Buffers, rows, tables, block_size: int) -> int:
        """Every staged field of the rows into the host buffer, then the padding rows past them
        (their token 0 at position 0 of the padding slot and page); returns the end of what it
        wrote."""
        n, size, bs = len(rows), buf.size, block_size
        pad = size - n
        slot, page = 0, 0
        if pad:
            assert self.pools.pad is not None, "padding rows need the pools' padding slot and page"
            slot, page = self.pools.pad
        pos = [r.start_pos for r in rows]
        fields = (
            [r.token_ids[0] for r in rows],
            [r.slot for r in rows],
            pos,
            [r.block_ids[q // bs] * bs + q % bs for r, q in zip(rows, pos)],
            [q + 1 for q in pos],
        )
        vals: list[int] = []
        for values, fill in zip(fields, (0, slot, 0, page * bs, 1)):  # STAGED's order, each padded to size
            vals += values
            vals += [fill] * pad
        host = buf.host_np
        head = _width_at(size) + 1  # the width, then the packed tables
        w = tables.rows_into(rows, host[head:], SLACK_PAGES, self.width) if rows else 1
        assert w <= self.width, f"a row of {w} pages, past the widest a request can have ({self.width})"
        if pad:
            host[head + n * w : head + size * w] = page
        vals.append(w)
        host[:head] = vals
        buf.rows = n
        buf.ahead = 0
        buf.by_offset = {}
        for i, q in enumerate(pos):
            buf.by_offset.setdefault(q % bs, []).append(i)
        return head + size * w

    def _advance(self, buf: _Buffers, rows, tables, block_size: int) -> int:
        """The host buffer of the last step, staged from these rows a token back, moved on in
        place: the new ids; positions, slots in the cache and lengths one on, but for the rows
        whose new token opens a page (known from their offsets in a page at the last `_write`),
        which get that page in their packed table and their slot at its start. A row past the
        packed width has every table packed again (`_write`). No per-row Python but the ids'
        list and the rows that open a page (one in block_size a step)."""
        n, size, bs, host = len(rows), buf.size, block_size, buf.host_np
        head = _width_at(size) + 1
        buf.ahead += 1
        opening = buf.by_offset.get(-buf.ahead % bs, ())
        w = int(host[head - 1])
        new_pages = [(i, rows[i].start_pos // bs) for i in opening]  # (row, index of its page)
        if any(j >= w for _, j in new_pages):  # a page past the packed width
            return self._write(buf, rows, tables, bs)
        host[:n] = [r.token_ids[0] for r in rows]
        host[2 * size : 5 * size].reshape(3, size)[:, :n] += 1  # the padding rows stay at position 0
        for i, j in new_pages:
            page = rows[i].block_ids[j]
            host[head + i * w + j] = page
            host[3 * size + i] = page * bs
        return head + size * w

    @torch.inference_mode()
    def run(self, b: ForwardBatch) -> torch.Tensor | None:
        """The step's logits [rows, vocab] float32 through its size's graph (or its buffers), or
        None: the caller runs the step eagerly. The logits live in the graph's memory until the
        next replay of that size; a padded step's are the first rows of its size's."""
        self.replayed = False
        if not self.covers(b):
            return None
        assert b.decode is not None
        n = b.decode.num_rows
        g = self.sizes.get(n)
        if (self.packed or self.buckets) and (g is None or g.buffers.batch is not b):  # general: as it is
            return None
        self.covered += 1
        if g is None:
            g = self.sizes[n] = _Graph(_Buffers.like(b, self.width))
        if g.buffers.batch is not b:  # a batch built the general way: into the buffers
            g.buffers.load(b)
        rows = g.buffers.rows
        if not g.buffers.stepped:  # first step of this size: eagerly, on the buffers
            g.buffers.stepped = True
            return self._eager(g)[:rows]
        if not self.capture:
            return self._eager(g)[:rows]
        if g.graph is None and not self._capture(n, g):
            return self._eager(g)[:rows]
        assert g.graph is not None and g.logits is not None
        g.graph.replay()
        self.replays += 1
        self.replayed = True
        return g.logits[:rows]

    def capture_all(self, block_size: int) -> None:
        """Every bucket's graph, largest first (the smaller ones reuse its memory), each on a step
        of padding rows alone: run once eagerly (every kernel built for its shapes), then captured.
        With capture off (the CPU tests), the eager steps alone. Logs its progress every few
        seconds and what it took."""
        t0 = last = time.perf_counter()
        sizes = sorted(self.buckets, reverse=True)
        log.info("capturing the decode step's CUDA graphs for %d batch sizes (%s)", len(sizes), _ranges(sizes[::-1]))
        for i, size in enumerate(sizes):
            if size in self.failed:
                continue
            g = self.sizes.get(size)
            if g is None or g.buffers.flat is None:
                g = self.sizes[size] = _Graph(_Buffers.staged(size, self.width, self.model.embed.device, self.packed))
            buf = g.buffers
            if buf.pending is not None:
                buf.pending.synchronize()
            self._loaded(buf, self._write(buf, [], None, block_size))
            buf.stepped = True
            with torch.inference_mode():  # as `run` steps (the buffers themselves are made outside it)
                self._eager(g)
                if self.capture and g.graph is None:
                    self._capture(size, g, logging.DEBUG)
            if time.perf_counter() - last > 2.0 and i + 1 < len(sizes):
                last = time.perf_counter()
                log.info("  %d of %d decode graphs captured (%.1f s)", i + 1, len(sizes), last - t0)
        self.last_staged = None
        captured = sum(1 for b in sizes if b in self.sizes and self.sizes[b].graph is not None)
        log.info("decode graphs: %d of %d captured in %.1f s", captured, len(sizes), time.perf_counter() - t0)

    def _forward(self, g: _Graph) -> torch.Tensor:
        if not self.packed:
            g.buffers.expand()
        return self.model.forward(g.buffers.batch, self.pools)

    def _eager(self, g: _Graph) -> torch.Tensor:
        if self.stream is None:
            return self._forward(g)
        cur = torch.cuda.current_stream()
        self.stream.wait_stream(cur)
        with torch.cuda.stream(self.stream):  # the stream the capture will use: same handles, same workspaces
            out = self._forward(g)
        cur.wait_stream(self.stream)
        return out

    def _capture(self, n: int, g: _Graph, level: int = logging.INFO) -> bool:
        t0 = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        try:
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                g.logits = self._forward(g)
        except Exception as e:  # capture refused (a host sync in some op): this size stays eager
            self.failed.add(n)
            self.sizes.pop(n, None)
            torch.cuda.synchronize()
            log.warning("CUDA graph capture failed at batch %d, it runs eagerly: %s: %s", n, type(e).__name__, e)
            return False
        self.pool = graph.pool()
        g.graph = graph
        log.log(
            level, "captured the decode step's CUDA graph for batch %d in %.0f ms", n, 1e3 * (time.perf_counter() - t0)
        )
        return True


def _ranges(sizes: Sequence[int]) -> str:
    """1, 2, 4, 8 .. 64 by 8: sizes as a short text for the log."""
    return ", ".join(str(b) for b in sizes) if len(sizes) <= 6 else f"{sizes[0]} .. {sizes[-1]}"

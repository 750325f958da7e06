"""The batched sampler on rank 0: one pass of tensor ops over every position a step samples
(penalties, logit_bias and min_tokens, then argmax or a draw after the filters),
drafts verified by the same draws. The host plans a call into one HostPack (engine/sampling/
pack.py): at most two host-to-device copies a call, whatever the batch, and one host read (the
ids, with the logprobs rows' entries and the head rows' checks in the same read). Only a top-p /
min-p row whose 1024 most likely tokens do not hold its kept set costs a second read, after its
sorted draw. A call over the same rows as the last, each a token (or the same number of tokens)
further on, reuses the last plan and its uploads, advancing the draws' counters on the device; on
CUDA, once a plan has been reused twice, its device work is captured in a CUDA graph and replayed
(docs/engine.md, "CUDA graphs")."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from engine.sampling import adjust as adjusting
from engine.sampling import draw as drawing
from engine.sampling.pack import HostPack, Sections
from engine.sampling.penalties import TokenCounts
from kernels import cpu_ops
from kernels.triton import force_triton

log = logging.getLogger("pdserve.engine")

# (token id, log-probability, [(id, log-probability) of the n most likely, most likely first])
TokenLogprob = tuple[int, float, list[tuple[int, float]]]


def token_logprobs(logprobs: torch.Tensor, targets: list[int], n: int) -> list[TokenLogprob]:
    """logprobs [R, V] (log-softmax) and one target id per row -> each target's log-probability
    and the n most likely ids of its row (ties: the lower id first, as torch.topk orders them).
    One host read."""
    t = torch.tensor(targets, device=logprobs.device)[:, None]
    got = _logprob_cols(logprobs, t, n).double().tolist()
    return [_entry(tk, r, n) for tk, r in zip(targets, got)]


def _logprob_cols(logprobs: torch.Tensor, targets: torch.Tensor, n: int) -> torch.Tensor:
    """[R, 1 + 2n]: the target's log-probability, the n largest, their ids (exact in float32)."""
    cols = [logprobs.gather(-1, targets)]
    if n:
        top = torch.topk(logprobs, n, dim=-1)
        cols += [top.values, top.indices.to(logprobs.dtype)]
    return torch.cat(cols, 1)


def _entry(token: int, r: list[float], n: int) -> TokenLogprob:
    return (token, r[0], [(int(i), v) for v, i in zip(r[1 : 1 + n], r[1 + n : 1 + 2 * n])])


@dataclass
class _CallPlan:
    """A call's plan (the positions, the adjustments, the draws) and its uploaded sections, kept
    for a next call over the same rows (`Sampler._reuse`)."""

    key: tuple
    nums: list[int]  # each row's num_output the counters were made for
    n: int
    pos: list[int]
    everything: bool
    lp_rows: list[int]
    lp_at: list[tuple[int, int]]  # (index in rows, draft position) of each logprobs position
    adj: adjusting.Adjust | None
    sampled: list[int]
    greedy: list[int]
    dp: drawing.DrawPlan | None
    s: Sections
    counters: list[str]  # int sections of the draws' counters (num_output + draft index)
    graphable: bool = False  # its device work may be replayed from a CUDA graph (`Sampler._graphed`)
    constrained: bool = False  # a row has a grammar (and the sampler one to apply: `Sampler._constrain`)
    reuses: int = 0  # calls that reused it
    graph: Any = None  # (torch.cuda.CUDAGraph, the logits it reads, the tokens it writes)


def _call_key(rows, first: list[int], num_logits: int) -> tuple:
    """What a plan depends on besides the rows' token counts: the rows, their positions and
    params, how many of each one's positions are still under its min_tokens."""
    return (num_logits,) + tuple(
        (r.request_id, r.num_draft, j, id(r.params), adjusting.banned(r)) for r, j in zip(rows, first)
    )


def _positions(rows) -> list[tuple]:
    """Per position: its row's params and the request's new-token index."""
    return [(r.params, r.num_output + d) for r in rows for d in range(r.num_draft + 1)]


class Sampler:
    def __init__(
        self,
        seed: int = 0,
        eos_token_ids: tuple[int, ...] = (),
        device: str | torch.device = "cpu",
        grammar=None,
        graphs: bool = True,
    ):
        self.device = torch.device(device)
        self.graphs = graphs  # cuda: a reused call plan may be replayed from a CUDA graph (--cuda-graphs)
        self.grammar = grammar  # engine.structured.GrammarMask: structured outputs' token masks
        self.gen = torch.Generator(device=self.device).manual_seed(seed)  # unseeded requests' draws
        self.eos = tuple(eos_token_ids)
        self.counts: TokenCounts | None = None  # made at the first penalized row (it needs V)
        self._fused: bool | None = None
        self._plan: _CallPlan | None = None  # the last call's, for the next call with the same rows
        self.replays = 0  # calls whose device work was replayed from a CUDA graph
        self._ones: torch.Tensor | None = None  # every token allowed, for the CPU's argmax (`_argmax`)

    @property
    def fused(self) -> bool:
        """Draws, penalties and count updates in Triton kernels: on CUDA where they build (checked
        at the first call), or anywhere with PDSERVE_FORCE_TRITON=1."""
        if self._fused is None:
            if force_triton():
                self._fused = True
            elif self.device.type == "cuda":
                from kernels.triton.sampling import available

                self._fused = available(self.device)
            else:
                self._fused = False
        return self._fused

    def drop(self, request_ids: list[str]) -> None:
        if request_ids:
            self._plan = None
        if self.grammar is not None:
            self.grammar.drop(request_ids)
        if self.counts is not None:
            self.counts.drop(request_ids)

    @torch.inference_mode()
    def adjust(self, x: torch.Tensor, rows, pos: list[int]) -> list[int]:
        """In place on x [N, V] float32, the logits the positions sample from: logit_bias, EOS and
        stop ids at -inf while fewer than min_tokens new tokens exist, then the penalties
        (docs/api.md; engine/sampling/adjust.py). rows: each has .request_id, .params,
        .num_output, .num_draft, .token_ids and .history = (prompt ids, output ids) where it has
        penalties; pos[i]: the position of row i's first draw, its drafts' after it. Returns the
        index in `rows` of each penalized row."""
        pack = HostPack()
        a = self._plan_adjust(pack, rows, pos, x.shape[1], x.device)
        self._apply_adjust(x, a, pack.upload(x.device))
        adjusting.release(a, self.counts)
        return a.pen

    def _plan_adjust(self, pack: HostPack, rows, pos: list[int], v: int, dev: torch.device) -> adjusting.Adjust:
        if self.counts is None and any(r.params.penalized for r in rows):
            self.counts = TokenCounts(v, dev, self.fused)
        return adjusting.plan(self.counts, pack, rows, pos, v, self.eos)

    def _apply_adjust(self, x: torch.Tensor, a: adjusting.Adjust, s: Sections) -> None:
        adjusting.apply(x, a, s, self.counts)

    @torch.inference_mode()
    def __call__(
        self, logits: torch.Tensor, rows, first: list[int], static: bool = False, steady: bool = False
    ) -> tuple[list[list[int]], dict[str, list]]:
        """logits [L, V] float32 of a step, which the sampler may overwrite; rows: the RowInputs
        that sample (engine/step.py), row i scoring positions first[i] .. first[i] + num_draft.
        Returns the emitted tokens of each row and {request id: [TokenLogprob]} for rows with
        params.logprobs (of the model's own distribution: log-softmax of the logits before any
        adjustment). static: the logits are at the same address each call (a CUDA graph's output),
        so a plan's device work may be replayed from a graph of its own. steady (StepInput.steady):
        the rows are the last call's, each a token further on, so its plan holds as it is."""
        dev, v = logits.device, logits.shape[-1]
        cp = self._steady(len(rows), logits.shape[0]) if steady else None
        if cp is None:
            key = _call_key(rows, first, logits.shape[0])
            cp = self._reuse(rows, key)
            if cp is None:
                cp = self._plan = self._plan_call(rows, first, key, v, dev)
        n, pos, s, adj, dp, lp_rows = cp.n, cp.pos, cp.s, cp.adj, cp.dp, cp.lp_rows
        nlp = max((rows[i].params.logprobs for i in lp_rows), default=0)
        try:
            tokens = self._graphed(cp, logits) if static and cp.graphable and cp.reuses >= 2 else None
            if tokens is not None:  # the graph records the penalties' counts too
                got, lp = self._read(tokens, None, None, None, 0)
            else:
                x = logits if cp.everything else logits[s["idx"]]
                lsm = torch.log_softmax(logits[s["lp.first"]], -1) if lp_rows else None  # before the adjustments
                if adj is not None:
                    self._apply_adjust(x, adj, s)
                grammar = self._constrain(x, rows, pos, all_greedy=dp is None) if cp.constrained else None
                tokens, held = self._pick(cp, x, grammar)
                got, lp = self._read(tokens, held, lsm, s if lp_rows else None, nlp)
                if held is not None and not all(got[n : n + len(held)]):
                    per = _positions(rows)
                    tokens = self._redraw(x, dp, cp.sampled, per, got[n : n + len(held)], tokens, cp.everything)
                    got, lp = self._read(tokens, None, lsm, s if lp_rows else None, nlp)
                if adj is not None:
                    adj.built = False  # loaded: a call that reuses the plan has nothing more to load
                if adj is not None and adj.pen:
                    assert self.counts is not None
                    adjusting.record(adj, s, self.counts, tokens)
            emitted = self._emitted(rows, pos, got)
            if adj is not None and adj.pen:
                assert self.counts is not None
                self.counts.advance([rows[i].request_id for i in adj.pen], [emitted[i] for i in adj.pen])
        finally:  # a call that raised gives its lent scratch rows back too (adjust.release)
            if adj is not None:
                adjusting.release(adj, self.counts)
        if not lp_rows:
            return emitted, {}
        out_lp: dict[str, list] = {}
        for (i, d), r in zip(cp.lp_at, lp):
            if d < len(emitted[i]):  # a position whose token the row emits
                t, val, top = _entry(got[pos[i] + d], r, nlp)
                out_lp.setdefault(rows[i].request_id, []).append((t, val, top[: rows[i].params.logprobs]))
        return emitted, out_lp

    def _argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's first largest logit. On the CPU the C operator with every token allowed (one
        vectorized pass: 1.3 ms against max's 3.2 ms at 64 x 151,936, docs/benchmarks.md); else
        max's index, as argmax in a quarter of its time. A NaN is never the largest on the CPU."""
        if x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1 and cpu_ops.available(x.dtype):
            words = (x.shape[1] + 31) // 32
            ones = self._ones
            if ones is None or ones.shape[0] < x.shape[0] or ones.shape[1] != words:
                ones = self._ones = torch.full((x.shape[0], words), -1, dtype=torch.int32)
            return cpu_ops.masked_argmax(x, ones[: x.shape[0]])
        return x.max(-1).indices

    @staticmethod
    def _emitted(rows, pos: list[int], got: list[int]) -> list[list[int]]:
        """Each row's emitted tokens: its first, then one more for each draft the draws agree with."""
        # no drafts (each row one place, the last too): one token a row
        if not rows or (pos[-1] == len(rows) - 1 and not rows[-1].num_draft):
            return [[t] for t in got[: len(rows)]]
        emitted = []
        for r, q in zip(rows, pos):
            k = r.num_draft
            out = got[q : q + 1]
            for d, t in zip(r.token_ids[len(r.token_ids) - k :] if k else (), got[q : q + k]):
                if t != d:
                    break
                out.append(got[q + len(out)])
            emitted.append(out)
        return emitted

    def _pick(
        self, cp: _CallPlan, x: torch.Tensor, tokens: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The ids [n] from the adjusted x (tokens: the grammar's, when it took them all) and the
        head group's checks (None without one): greedy positions by argmax, the others drawn."""
        if tokens is not None or cp.dp is None:
            return (self._argmax(x) if tokens is None else tokens), None
        tokens = torch.empty(cp.n, dtype=torch.long, device=x.device)
        if cp.greedy:
            at = cp.s["greedy"]
            tokens[at] = self._argmax(x[at])
        return tokens, drawing.draw(x, cp.dp, cp.s, tokens, self.gen, cp.sampled == list(range(cp.n)))

    def _device_work(self, cp: _CallPlan, logits: torch.Tensor) -> torch.Tensor:
        """A graphable plan's device work, as the eager path does it: the adjustments, the argmax
        or the draws, the penalties' count update. Returns the ids [n]."""
        s, adj = cp.s, cp.adj
        x = logits if cp.everything else logits[s["idx"]]
        if adj is not None:
            self._apply_adjust(x, adj, s)
        tokens, _ = self._pick(cp, x, None)
        if adj is not None and adj.pen:
            assert self.counts is not None
            adjusting.record(adj, s, self.counts, tokens)
        return tokens

    def _graphed(self, cp: _CallPlan, logits: torch.Tensor) -> torch.Tensor | None:
        """The call's ids from the plan's CUDA graph, captured at its third call (its kernels built
        and warm by then) over these logits; None where it cannot be (other logits than the graph
        reads, a refused capture): the call runs eagerly."""
        if cp.graph is not None:
            graph, seen, out = cp.graph
            if seen.data_ptr() != logits.data_ptr() or seen.shape != logits.shape or seen.stride() != logits.stride():
                return None
            graph.replay()
            self.replays += 1
            return out
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                out = self._device_work(cp, logits)
        except Exception as e:  # a capture the ops refuse: this plan stays eager
            cp.graphable = False
            torch.cuda.synchronize()
            log.warning("sampler CUDA graph capture failed, the plan runs eagerly: %s: %s", type(e).__name__, e)
            return None
        cp.graph = (graph, logits, out)
        graph.replay()
        self.replays += 1
        return out

    def _plan_call(self, rows, first: list[int], key: tuple, v: int, dev: torch.device) -> _CallPlan:
        """The host's plan of a call and its one upload (the module)."""
        num_logits = key[0]
        idx, pos = [], []
        for r, j in zip(rows, first):
            pos.append(len(idx))
            idx += range(j, j + r.num_draft + 1)
        pack = HostPack()
        everything = idx == list(range(num_logits))
        if not everything:
            pack.ints("idx", idx)
        lp_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        lp_at = [(i, d) for i in lp_rows for d in range(rows[i].num_draft + 1)]  # each position a row scores
        if lp_rows:
            pack.ints("lp.first", [first[i] + d for i, d in lp_at])
            pack.ints("lp.pos", [pos[i] + d for i, d in lp_at])
        adj = None
        if any(r.params.penalized or r.params.biased or r.num_output < r.params.min_tokens for r in rows):
            adj = self._plan_adjust(pack, rows, pos, v, dev)
        per = _positions(rows)
        sampled = [q for q, (p, _) in enumerate(per) if not p.greedy]
        greedy = [q for q, (p, _) in enumerate(per) if p.greedy]
        if sampled and greedy:
            pack.ints("greedy", greedy)
        dp = drawing.plan(pack, sampled, [per[q] for q in sampled], v, fused=self.fused) if sampled else None
        counters = [name for name in pack.names() if name.startswith("draw.") and name.endswith(".ctr")]
        nums = [r.num_output for r in rows]
        cp = _CallPlan(
            key, nums, len(idx), pos, everything, lp_rows, lp_at, adj, sampled, greedy, dp, pack.upload(dev), counters
        )
        cp.constrained = self.grammar is not None and any(r.params.constraint is not None for r in rows)
        cp.graphable = (
            dev.type == "cuda"
            and self.fused
            and self.graphs
            and os.environ.get("PDSERVE_CUDA_GRAPHS", "1") != "0"
            and not lp_rows
            and not cp.constrained
            and not (adj is not None and adj.depth)  # its scratch rows are the call's own
            and (adj is not None or dp is not None)  # greedy alone is one launch: nothing to gain
            and (dp is None or ("head" not in dp.groups and not dp.num_unseeded and not any(dp.fused.values())))
        )
        return cp

    def _steady(self, num_rows: int, num_logits: int) -> _CallPlan | None:
        """The last call's plan for a steady call (its rows, each a token on, none crossing its
        min_tokens: the same key, and penalty tables the last call advanced): its draws' counters
        one on. None where there is none for as many rows and logits (a plan dropped since)."""
        cp = self._plan
        if cp is None or cp.key[0] != num_logits or len(cp.nums) != num_rows or cp.n != num_rows:
            return None
        if cp.adj is not None and cp.adj.pen and not (self.counts is not None and self.counts.room()):
            return None  # a table to widen: `_reuse` finds it and plans the call again
        return self._moved(cp, 1, [c + 1 for c in cp.nums])

    @staticmethod
    def _moved(cp: _CallPlan, d: int, nums: list[int]) -> _CallPlan:
        """The plan reused for rows each d tokens further on (their num_output now `nums`): its
        draws' counters advanced on the device, nothing uploaded."""
        if d:
            for name in cp.counters:
                cp.s[name].add_(d)
            cp.nums = nums
        cp.reuses += 1
        return cp

    def _reuse(self, rows, key: tuple) -> _CallPlan | None:
        """The last call's plan where this call has the same rows at the same positions, each
        moved on by the same number of tokens (a decode step after a decode step) and their
        penalty tables current: its draws' counters advanced on the device, nothing uploaded."""
        cp = self._plan
        if cp is None or not rows or key != cp.key:
            return None
        d = rows[0].num_output - cp.nums[0]
        if any(r.num_output - c != d for r, c in zip(rows, cp.nums)):
            return None
        if cp.adj is not None and cp.adj.depth:
            return None  # its drafts (and the scratch rows lent for them) were the last call's
        if cp.adj is not None and cp.adj.pen:
            assert self.counts is not None
            pen = [rows[i] for i in cp.adj.pen]
            if not self.counts.current([r.request_id for r in pen], [r.history for r in pen]):
                return None
        return self._moved(cp, d, [r.num_output for r in rows] if d else cp.nums)

    def _constrain(self, x: torch.Tensor, rows, pos: list[int], all_greedy: bool) -> torch.Tensor | None:
        """The grammar on x (engine/structured): the tokens when every position is greedy and one
        CPU op takes the masked argmax; else None, with x masked for the draws."""
        assert self.grammar is not None
        tokens = self.grammar.greedy(x, rows, pos) if all_greedy else None
        if tokens is None:
            self.grammar.apply(x, rows, pos)
        return tokens

    @staticmethod
    def _read(tokens, held, lsm, s: Sections | None, nlp: int) -> tuple[list[int], list[list[float]]]:
        """The call's one host read: the ids, then the head rows' checks, then the logprobs rows'
        [target, n largest, their ids] (float64 holds every id exactly)."""
        if held is None and lsm is None:  # the ids alone (most calls): no cast, no concatenation
            got = tokens.tolist()
        else:
            parts = [tokens.double()]
            if held is not None:
                parts.append(held.double())
            if lsm is not None:
                assert s is not None
                parts.append(_logprob_cols(lsm, tokens[s["lp.pos"]][:, None], nlp).double().flatten())
            got = torch.cat(parts).tolist()
        n, h = tokens.shape[0], 0 if held is None else held.shape[0]
        ids = [int(t) for t in got[: n + h]]
        w = 1 + 2 * nlp
        lp = [got[n + h + a : n + h + a + w] for a in range(0, len(got) - n - h, w)]
        return ids, lp

    def _redraw(self, x, dp, sampled, per, held, tokens, everything) -> torch.Tensor:
        """Head rows whose head did not hold their kept set, drawn again over the sorted row (a
        sort of the vocabulary costs about 15 times a top-k of HEAD on the CPU)."""
        members = [j for j, ok in zip(dp.groups["head"][0], held) if not ok]
        pack = HostPack()
        again = drawing.plan(
            pack, [sampled[j] for j in members], [per[sampled[j]] for j in members], x.shape[-1], "again", False
        )
        drawing.draw(x, again, pack.upload(x.device), tokens, self.gen, False)
        return tokens

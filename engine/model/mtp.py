"""The multi-token-prediction (MTP) block of a Qwen3.5 checkpoint, used as the speculative drafter,
and `MTPDrafter`, which runs it after each step over the positions whose next token became known
(filling its KV) and then for the next drafts; a row that drafts nothing defers its fill
(docs/speculative.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.model.batch import ForwardBatch, IntPack, group_fields, make_group
from engine.model.layers import AllReduce
from engine.model.linear import Linear
from engine.model.qwen3_5 import DecoderLayer, build_layer, run_layer
from engine.model.rotary import Rotary
from engine.step import DraftFill, RowInput
from kernels import add_rms_norm


class MTPBlock:
    def __init__(
        self, cfg: ModelConfig, weights: dict, embed: torch.Tensor, lm_head: Linear, tp: int, all_reduce: AllReduce
    ):
        self.eps = cfg.rms_norm_eps
        self.embed, self.lm_head = embed, lm_head
        self.norm_embed = 1.0 + weights["norm_embed"].float()  # zero-centred norms: (1 + w), precomputed
        self.norm_hidden = 1.0 + weights["norm_hidden"].float()
        self.fc = weights["fc"]
        self.norm = 1.0 + weights["norm"].float()
        self.first_layer = cfg.num_layers  # the block's layers are numbered after the main ones
        self.layers: list[DecoderLayer] = [
            build_layer(cfg, cfg.num_layers + j, "full_attention", lw, tp, all_reduce)
            for j, lw in enumerate(weights["layers"])
        ]

    def __call__(
        self, ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, kv: dict[int, torch.Tensor], cos, sin
    ) -> torch.Tensor:
        """ids [T] (the next tokens), hidden [T, H] (main model, after its final norm) -> the
        block's normed output [T, H]; writes the block's KV at batch.slot_mapping."""
        # add_rms_norm with no residual: the norm alone, one fused C call on the CPU
        _, e = add_rms_norm(F.embedding(ids, self.embed), None, self.norm_embed, self.eps)
        _, h = add_rms_norm(hidden.contiguous(), None, self.norm_hidden, self.eps)
        x = self.fc(torch.cat([e, h], dim=-1))
        for j, layer in enumerate(self.layers):
            x = run_layer(layer, x, batch, None, kv[self.first_layer + j], cos, sin, self.eps)
        return add_rms_norm(x.contiguous(), None, self.norm, self.eps)[1]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h).float()


DECODE_ROWS_MAX = 256  # MTP rows up to this long run as a decode group (the C attention on the CPU)


def mtp_batch(rows, block_size: int, device) -> ForwardBatch:
    """A batch of MTP rows (start_pos, num_tokens, block_ids) as one group: a decode group while
    no row is longer than DECODE_ROWS_MAX (drafting passes, the fill after a decode step, a
    deferred fill: on the CPU one C attention call, token by token, in order within a row), else
    a prefill group (a long prompt chunk: the general attention path); the block has no GDN state,
    so slots are unused."""
    pack = IntPack()
    pos, slots = [], []
    for start, n, blocks in rows:
        p = range(start, start + n)
        pos += p
        slots += [blocks[q // block_size] * block_size + q % block_size for q in p]
    fields = [pack.add(pos), pack.add(slots)]
    last, tok = [], 0
    for _, n, _ in rows:
        tok += n
        last.append(tok - 1)
    fields.append(pack.add(last))
    gf = group_fields(pack, [n for _, n, _ in rows], [0] * len(rows), [s for s, _, _ in rows], [b for _, _, b in rows])
    pack.build(device)
    one = all(n <= DECODE_ROWS_MAX for _, n, _ in rows)
    grp = make_group(0, pack, gf, decode=one)
    return ForwardBatch(
        input_ids=pack[fields[0]],  # unused: the block takes its ids separately
        positions=pack[fields[0]],
        slot_mapping=pack[fields[1]],
        decode=grp if one else None,
        prefill=None if one else grp,
        logits_indices=pack[fields[2]],
    )


class MTPDrafter:
    """Runs the MTP block after a step: fills its KV at the newly known positions and drafts."""

    def __init__(
        self,
        block: MTPBlock,
        rotary: Rotary,
        block_size: int,
        max_positions: int,
        device,
        max_pending: int = 128,
        page_ends: bool = False,
    ):
        self.block, self.rotary = block, rotary
        self.block_size, self.max_positions, self.device = block_size, max_positions, device
        self.max_pending = max_pending
        self.page_ends = page_ends  # never defer a page's last position (prefix caching)
        # request id -> [first position, next-token ids, hidden-state chunks]: deferred KV fills
        self.pending: dict[str, list] = {}

    def drop(self, request_ids) -> None:
        for rid in request_ids:
            self.pending.pop(rid, None)

    def resume(self, request_id: str, pos: int, token: int, hidden: torch.Tensor) -> None:
        """A request resuming from a cached prefix at pos + 1 (engine/cache/prefix.py): its KV at
        pos, cached with another prompt's next token, is computed again with `token` (its own)
        in its first chunk."""
        self.pending[request_id] = [pos, [token], [hidden.unsqueeze(0).clone()]]

    @torch.inference_mode()
    def fill(self, fills: list[DraftFill], kv) -> None:
        """Finished requests' deferred positions (a step without rows, before their final
        snapshots are copied: PrefixPlanner.keep_final), as one MTP pass without drafts."""
        rows, ids, hid = [], [], []
        for f in fills:
            p = self.pending.pop(f.request_id, None)
            # not past the tail page: positions after a stop token that accepted drafts ran past
            n = min(len(p[1]), len(f.block_ids) * self.block_size - p[0]) if p is not None else 0
            if n > 0:
                rows.append((p[0], n, f.block_ids))
                ids += p[1][:n]
                hid.append(torch.cat(p[2])[:n])
        if rows:
            batch = mtp_batch(rows, self.block_size, self.device)
            self._run(torch.tensor(ids, device=self.device), torch.cat(hid), batch, kv)

    def _take(self, r: RowInput) -> tuple[int, list[int], list[torch.Tensor]]:
        """The request's deferred positions, if they end where this row starts (a preempted
        request computes everything again: its old ones are dropped). The lists are the entry's
        own: a row that defers again appends to them."""
        p = self.pending.pop(r.request_id, None)
        if p is None or p[0] + len(p[1]) != r.start_pos:
            return r.start_pos, [], []
        return p[0], p[1], p[2]

    @torch.inference_mode()
    def __call__(self, rows: list[RowInput], hidden: torch.Tensor, emitted: list[list[int]], kv) -> list[list[int]]:
        """rows: the step's rows; hidden [T, H]: the main model's normed hidden state at every
        token of the step; emitted[i]: row i's emitted tokens (empty when it did not sample).
        Returns the drafts of every row (empty for rows that do not draft)."""
        bs = self.block_size
        seg, ids, hid = [], [], []  # (row, start_pos, n, blocks, depth) per MTP row
        off = 0
        for i, r in enumerate(rows):
            n = len(r.token_ids)
            known = r.token_ids[1 : n - r.num_draft]
            nxt = emitted[i] if r.sample else ([r.next_token] if r.next_token is not None else [])
            m = len(known) + len(nxt)  # positions start_pos .. start_pos + m - 1 have their next token
            if m > 0:
                start, p_ids, p_hid = self._take(r)
                h = hidden[off : off + m]
                d = r.draft_depths[min(len(nxt), len(r.draft_depths)) - 1] if r.sample and r.draft_depths else 0
                # a prompt's last position is never deferred: its page may be cached right after;
                # with prefix caching, neither is a page's last position (the page is cached)
                ends_page = self.page_ends and (r.start_pos + m) // bs > r.start_pos // bs
                defer = r.sample and r.is_decode and d == 0 and r.num_output > 0 and not ends_page
                if defer and len(p_ids) + m <= self.max_pending:
                    p_ids += known
                    p_ids += nxt
                    p_hid.append(h.clone())
                    self.pending[r.request_id] = [start, p_ids, p_hid]
                else:
                    cap = min(len(r.block_ids) * bs, self.max_positions) - (r.start_pos + m - 1)
                    depth = max(0, min(d, cap))
                    seg.append((i, start, len(p_ids) + m, r.block_ids, depth))
                    ids += p_ids + known + nxt
                    hid += [*p_hid, h]
            off += n
        drafts: list[list[int]] = [[] for _ in rows]
        if not seg:
            return drafts
        batch = mtp_batch([(s, m, b) for _, s, m, b, _ in seg], bs, self.device)
        out = self._run(torch.tensor(ids, device=self.device), torch.cat(hid), batch, kv)
        live = [j for j, sg in enumerate(seg) if sg[4] > 0]
        if not live:
            return drafts
        h = out[batch.logits_indices[torch.tensor(live, device=self.device)]]
        tok = self.block.logits(h).argmax(-1)
        for step in range(max(seg[j][4] for j in live)):
            for j, t in zip(live, tok.tolist()):
                drafts[seg[j][0]].append(t)
            live_next = [q for q, j in enumerate(live) if seg[j][4] > step + 1]
            if not live_next:
                break
            sel = torch.tensor(live_next, device=self.device)
            live = [live[q] for q in live_next]
            h, tok = h[sel], tok[sel]
            # the draft just made sits at position (last known position) + step + 1
            batch = mtp_batch([(seg[j][1] + seg[j][2] + step, 1, seg[j][3]) for j in live], bs, self.device)
            h = self._run(tok, h, batch, kv)
            tok = self.block.logits(h).argmax(-1)
        return drafts

    def _run(self, ids, hidden, batch: ForwardBatch, kv) -> torch.Tensor:
        cos, sin = self.rotary(batch.positions)
        return self.block(ids, hidden, batch, kv, cos, sin)

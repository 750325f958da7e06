"""The batched sampler on rank 0: one pass of tensor ops over every position a step samples
(penalties, logit_bias and min_tokens, then argmax or an inverse-CDF draw after the filters),
drafts verified by the same draws, one host read of the ids per step (a second for logprobs,
and one where top-p / min-p rows without top-k check their head; docs/engine.md)."""

from __future__ import annotations

import torch

from engine.sampling.filters import candidate_probs, head_suffices, inverse_cdf
from engine.sampling.penalties import TokenCounts
from engine.sampling.rng import as_int64, seeded_uniforms
from engine.sampling_params import SamplingParams

TOPK_LIMIT = 1024  # rows with a larger top_k sort the whole vocabulary
HEAD = 1024  # rows with top-p or min-p alone try the HEAD most likely tokens before a sort

# (token id, log-probability, [(id, log-probability) of the n most likely, most likely first])
TokenLogprob = tuple[int, float, list[tuple[int, float]]]


def token_logprobs(logprobs: torch.Tensor, targets: list[int], n: int) -> list[TokenLogprob]:
    """logprobs [R, V] (log-softmax) and one target id per row -> each target's log-probability
    and the n most likely ids of its row (ties: the lower id first, as torch.topk orders them).
    One host read."""
    t = torch.tensor(targets, device=logprobs.device)[:, None]
    cols = [logprobs.gather(-1, t)]
    if n:
        top = torch.topk(logprobs, n, dim=-1)
        cols += [top.values, top.indices.to(logprobs.dtype)]  # ids < 2**24: exact in float32
    got = torch.cat(cols, 1).double().tolist()
    return [(tk, r[0], [(int(i), v) for v, i in zip(r[1 : 1 + n], r[1 + n :])]) for tk, r in zip(targets, got)]


def _kind(top_k: int, p: SamplingParams) -> str:
    """How a sampled row draws: over torch.topk's candidates, over the sorted vocabulary (top-p or
    min-p without a small top-k), or over the whole vocabulary in id order (temperature alone)."""
    if 0 < top_k <= TOPK_LIMIT:
        return "topk"
    return "sort" if top_k or p.top_p < 1.0 or p.min_p else "plain"


def _tensor(values, dtype, device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


class Sampler:
    def __init__(
        self, seed: int = 0, eos_token_ids: tuple[int, ...] = (), device: str | torch.device = "cpu", grammar=None
    ):
        self.device = torch.device(device)
        self.grammar = grammar  # engine.structured.GrammarMask: structured outputs' token masks
        self.gen = torch.Generator(device=self.device).manual_seed(seed)  # unseeded requests' draws
        self.eos = tuple(eos_token_ids)
        self.counts: TokenCounts | None = None  # made at the first penalized row (it needs V)

    def drop(self, request_ids: list[str]) -> None:
        if self.grammar is not None:
            self.grammar.drop(request_ids)
        if self.counts is not None:
            self.counts.drop(request_ids)

    @torch.inference_mode()
    def adjust(self, x: torch.Tensor, rows, pos: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """In place on x [N, V] float32, the logits the positions sample from: penalties, then
        logit_bias, then EOS and stop ids at -inf while fewer than min_tokens new tokens exist
        (docs/api.md). rows: each has .request_id, .params, .num_output and .history =
        (prompt ids, output ids) where it has penalties; pos[i]: the position of row i's first
        draw. Rows with drafts have none of these (SamplingParams.speculates). Returns the index
        in `rows` of each penalized row and their rows of the token-count table."""
        n, v = x.shape
        dev = x.device
        pen = [i for i, r in enumerate(rows) if r.params.penalized]
        table_rows = None
        if pen:
            if self.counts is None:
                self.counts = TokenCounts(v, dev)
            got = self.counts.rows([rows[i].request_id for i in pen], [rows[i].history for i in pen])
            table_rows = _tensor(got, torch.long, dev)
            at = _tensor([pos[i] for i in pen], torch.long, dev)
            self.counts.apply(x, at, table_rows, [rows[i].params for i in pen])
        bias_at, bias_tok, bias_val, ban_at, ban_tok = [], [], [], [], []
        for i, r in enumerate(rows):
            p = r.params
            for t, b in p.logit_bias:
                if t < v:
                    bias_at.append(pos[i])
                    bias_tok.append(t)
                    bias_val.append(b)
            if r.num_output < p.min_tokens:
                for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos)):
                    if t < v:
                        ban_at.append(pos[i])
                        ban_tok.append(t)
        if bias_at:
            idx = (_tensor(bias_at, torch.long, dev), _tensor(bias_tok, torch.long, dev))
            x.index_put_(idx, _tensor(bias_val, torch.float32, dev), accumulate=True)
        if ban_at:
            x[_tensor(ban_at, torch.long, dev), _tensor(ban_tok, torch.long, dev)] = float("-inf")
        return pen, table_rows

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows, first: list[int]) -> tuple[list[list[int]], dict[str, list]]:
        """logits [L, V] float32 of a step, which the sampler may overwrite; rows: the RowInputs
        that sample (engine/step.py), row i scoring positions first[i] .. first[i] + num_draft.
        Returns the emitted tokens of each row and {request id: [TokenLogprob]} for rows with
        params.logprobs (of the model's own distribution: log-softmax of the logits before any
        adjustment)."""
        dev = logits.device
        idx, pos = [], []
        for r, j in zip(rows, first):
            pos.append(len(idx))
            idx += range(j, j + r.num_draft + 1)
        n = len(idx)
        x = logits if idx == list(range(logits.shape[0])) else logits[_tensor(idx, torch.long, dev)]
        lp_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        lsm = None
        if lp_rows:  # before the adjustments overwrite the logits
            lsm = torch.log_softmax(logits[_tensor([first[i] for i in lp_rows], torch.long, dev)], -1)
        pen, pool_rows = [], None
        if any(r.params.penalized or r.params.biased or r.num_output < r.params.min_tokens for r in rows):
            pen, pool_rows = self.adjust(x, rows, pos)
        if self.grammar is not None and any(r.params.constraint is not None for r in rows):
            self.grammar.apply(x, rows, pos)  # the batch's token bitmask, one op (engine/structured)
        # per position: its row's params and the request's new-token index
        per = [(r.params, r.num_output + d) for r in rows for d in range(r.num_draft + 1)]
        sampled = [q for q, (p, _) in enumerate(per) if not p.greedy]
        if not sampled:  # max's index: the first maximum, as argmax, in a quarter of its time on the CPU
            tokens = x.max(-1).indices
        else:
            tokens = torch.empty(n, dtype=torch.long, device=dev)
            greedy = [q for q, (p, _) in enumerate(per) if p.greedy]
            if greedy:
                at = _tensor(greedy, torch.long, dev)
                tokens[at] = x[at].max(-1).indices
        if sampled:
            self._draw(x, sampled, [per[q] for q in sampled], tokens)
        if pen:
            self.counts.record(pool_rows, tokens[_tensor([pos[i] for i in pen], torch.long, dev)])
        got = tokens.tolist()  # the step's one host read
        if pen:
            self.counts.advance([rows[i].request_id for i in pen], [got[pos[i]] for i in pen])
        emitted = []
        for r, q in zip(rows, pos):
            k = r.num_draft
            out = got[q : q + 1]
            for d, t in zip(r.token_ids[len(r.token_ids) - k :] if k else (), got[q : q + k]):
                if t != d:
                    break
                out.append(got[q + len(out)])
            emitted.append(out)
        if not lp_rows:
            return emitted, {}
        entries = token_logprobs(lsm, [got[pos[i]] for i in lp_rows], max(rows[i].params.logprobs for i in lp_rows))
        return emitted, {
            rows[i].request_id: [(t, lp, top[: rows[i].params.logprobs])] for i, (t, lp, top) in zip(lp_rows, entries)
        }

    def _draw(self, x: torch.Tensor, sampled: list[int], per: list[tuple[SamplingParams, int]], tokens) -> None:
        """Inverse-CDF draws for the sampled positions (their params and new-token index) into
        tokens[sampled]."""
        dev, v = x.device, x.shape[-1]
        seeds = [as_int64(p.seed) if p.seed is not None else 0 for p, _ in per]
        u = seeded_uniforms(_tensor(seeds, torch.long, dev), _tensor([i for _, i in per], torch.long, dev))
        unseeded = [j for j, (p, _) in enumerate(per) if p.seed is None]
        if unseeded:
            at = _tensor(unseeded, torch.long, dev)
            u[at] = torch.rand(len(unseeded), generator=self.gen, device=dev)
        ks = [p.top_k if 0 < p.top_k < v else 0 for p, _ in per]
        kind = [_kind(k, p) for k, (p, _) in zip(ks, per)]
        for name in ("topk", "sort", "plain"):
            group = [j for j, c in enumerate(kind) if c == name]
            if not group:
                continue
            q = [sampled[j] for j in group]
            xs = x if q == list(range(x.shape[0])) else x[_tensor(q, torch.long, dev)]
            g = [per[j][0] for j in group]
            temperature = _tensor([p.temperature for p in g], torch.float32, dev)
            gu = u if len(group) == len(per) else u[_tensor(group, torch.long, dev)]
            if name == "plain":  # temperature alone: the whole vocabulary in id order
                pick = inverse_cdf(torch.softmax(xs / temperature[:, None], -1), gu)
            else:
                top_k = _tensor([ks[j] for j in group], torch.long, dev) if any(ks[j] for j in group) else None
                top_p = _tensor([p.top_p for p in g], torch.float32, dev)
                min_p = _tensor([p.min_p for p in g], torch.float32, dev)
                log_total = None
                if name == "topk":
                    vals, ids = torch.topk(xs, max(ks[j] for j in group), dim=-1)
                else:
                    vals, ids, log_total = self._head(xs, temperature, top_k, top_p, min_p)
                probs = candidate_probs(vals, temperature, top_k, top_p, min_p, log_total)
                pick = ids.gather(1, inverse_cdf(probs, gu)[:, None])[:, 0]
            tokens[_tensor(q, torch.long, dev)] = pick

    @staticmethod
    def _head(xs, temperature, top_k, top_p, min_p):
        """Rows with top-p or min-p and no small top-k: (candidates sorted descending, their ids,
        the rows' log-normalizer or None). The HEAD largest logits when they hold every token
        the filters keep, in every row; else the whole row sorted (a sort of the vocabulary costs
        about 15 times a top-k of HEAD on the CPU). The check is this step's one extra host read."""
        if top_k is None and xs.shape[-1] > HEAD:
            vals, ids = torch.topk(xs, HEAD, dim=-1)
            log_total = torch.logsumexp(xs / temperature[:, None], dim=-1)
            if bool(head_suffices(vals, log_total, temperature, top_p, min_p).all()):
                return vals, ids, log_total
        vals, ids = torch.sort(xs, dim=-1, descending=True)
        return vals, ids, None

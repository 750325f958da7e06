"""A scheduler step's plan (engine/scheduler/output.py) as the workers' `StepInput`
(engine/step.py): each scheduled row's tokens, positions, pages, sampling and images. Most rows
of a decode step take `_decode_row`, the short path for one token past the prompt."""

from __future__ import annotations

from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRow, SchedulerOutput
from engine.step import ImageSpan, RowInput, StepInput


def step_input(so: SchedulerOutput, mtp: bool, merge: int, layer_posts: list[str]) -> StepInput:
    """merge: the vision tower's spatial merge size (0 without one); layer_posts: the requests
    whose state the step hands over layer by layer."""
    rows = []
    short = 0  # rows that took _decode_row without a rotary offset, drafts or MTP: plain decode rows
    for r in so.rows:
        req = r.request
        start = req.num_computed_tokens
        if r.is_decode and r.samples and start >= len(req.prompt_token_ids) and not req.want_logits:
            drafts = r.draft_token_ids
            rows.append(_decode_row(req, start, req.params, drafts, r.draft_depths if mtp else ()))
            short += not (req.rope_delta or mtp or drafts)
        else:
            rows.append(general_row(r, mtp, merge))
    saves = [c for _, c in so.saves]
    landed = [c for _, c in so.landed]
    restores = [c for _, c in so.restores]
    return StepInput(
        rows, so.finished_ids, restores, saves, layer_posts, landed, plain=bool(rows) and short == len(rows)
    )


def general_row(r: ScheduledRow, mtp: bool, merge: int) -> RowInput:
    """Any scheduled row as the workers' RowInput: a prompt chunk (with its images, 3-D rotary
    positions, prompt logprobs, the known token after it), or a decode row."""
    req, p, start = r.request, r.request.params, r.request.num_computed_tokens
    n_known = r.num_new_tokens - len(r.draft_token_ids)
    # prompt logprobs: every position of a chunk that still predicts prompt tokens
    plp = p.prompt_logprobs if p.prompt_logprobs is not None and start < len(req.prompt_token_ids) - 1 else None
    nxt = req.token_ids(start + n_known, start + n_known + 1) if (mtp or plp is not None) and not r.samples else []
    end = start + n_known + len(r.draft_token_ids)
    return RowInput(
        request_id=req.request_id,
        token_ids=req.token_ids(start, start + n_known) + r.draft_token_ids,
        start_pos=start,
        slot=_slot(req),
        block_ids=req.block_ids,  # the request's own list, not an O(context) copy (`_decode_row`)
        is_decode=r.is_decode,
        sample=r.samples,
        want_logits=req.want_logits and r.samples,
        params=req.params if r.samples else None,
        num_draft=len(r.draft_token_ids),
        next_token=nxt[0] if nxt else None,
        draft_depths=r.draft_depths if mtp and r.samples else (),
        prompt_logprobs=plp,
        num_output=len(req.output_token_ids),
        history=(req.prompt_token_ids, req.output_token_ids) if r.samples and _history(req, p) else None,
        mrope=req.rope_rows(start, end) if start < len(req.prompt_token_ids) else None,
        rope_delta=req.rope_delta,
        images=_image_spans(req, start, start + n_known, merge),
    )


def advance(last: StepInput, so: SchedulerOutput) -> StepInput | None:
    """The step after `last` (a plain step) as its own rows moved on by one token, where `so`
    schedules the same requests in the same order, each a plain decode row one token past its row
    in `last`: the persistent decode batch (docs/engine.md). The RowInputs are updated in place
    (three fields a row, against a new row's twenty); None where any row differs, after which the
    caller builds the step afresh and `last`'s rows are not used again. A row crossing its
    min_tokens changes what the sampler plans for it: not advanced."""
    rows = last.rows
    if len(so.rows) != len(rows) or so.restores or so.saves or so.landed:
        return None
    for r, row in zip(rows, so.rows):
        req = row.request
        start = req.num_computed_tokens
        out = req.output_token_ids
        if (
            req.request_id != r.request_id
            or start != r.start_pos + 1
            or r.block_ids is not req.block_ids
            or row.num_new_tokens != 1
            or row.draft_token_ids
            or not row.samples
            or len(out) == req.params.min_tokens
        ):
            return None
        r.token_ids = [out[start - len(req.prompt_token_ids)]]
        r.start_pos = start
        r.num_output = len(out)
    return StepInput(rows, so.finished_ids, plain=True, steady=True)


def _decode_row(req: Request, start: int, p: SamplingParams, drafts: list[int], depths: tuple[int, ...]) -> RowInput:
    """A decode row past the prompt that samples, without wanted logits: its one pending token
    and its drafts, sampled (MTP: the depths its next drafts take); the same row as the general
    path builds, in a third of its time. Its page list is the request's own, not a copy (a copy
    cost O(context) a row each step): the scheduler adds pages only between steps, and a worker
    in another process gets the step's lists as what they gained (engine/step_lists.py)."""
    out = req.output_token_ids
    token = [out[start - len(req.prompt_token_ids)]]
    return RowInput(
        req.request_id,
        token + drafts if drafts else token,
        start,
        _slot(req),
        req.block_ids,
        True,
        True,
        params=p,
        num_draft=len(drafts),
        draft_depths=depths,
        num_output=len(out),
        history=(req.prompt_token_ids, out) if _history(req, p) else None,
        rope_delta=req.rope_delta,
    )


def _history(req: Request, p: SamplingParams) -> bool:
    """Whether the sampler needs the request's ids: penalties, logit_bias, a grammar, min_tokens."""
    return bool(p.penalized or p.biased or p.constraint or len(req.output_token_ids) < p.min_tokens)


def _slot(req: Request) -> int:
    assert req.slot is not None, f"request {req.request_id} is scheduled without a GDN slot"
    return req.slot


def _image_spans(req: Request, start: int, end: int, merge: int) -> tuple[ImageSpan, ...]:
    """The images whose placeholder tokens a row over tokens [start, end) covers."""
    if not req.images or start >= len(req.prompt_token_ids):
        return ()
    assert merge, "a request with images on a model without a vision tower"
    out = []
    for img in req.images:
        lo, hi = max(start, img.offset), min(end, img.offset + img.num_tokens(merge))
        if lo < hi:
            out.append(ImageSpan(img, lo - img.offset, hi - img.offset, lo - start))
    return tuple(out)

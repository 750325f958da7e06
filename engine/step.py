"""What the scheduler sends each rank for one step, and what rank 0 sends back.
Plain dataclasses: pickled across a pipe for tensor-parallel worker processes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams
from engine.vision.inputs import ImageInput

if TYPE_CHECKING:
    from engine.sampling import TokenLogprob
    from engine.sampling.prompt_logprobs import PromptLogprob


@dataclass(frozen=True)
class ImageSpan:
    """Image tokens [lo, hi) of `image` (of its num_tokens) sit at the row's token_ids[at:]."""

    image: ImageInput
    lo: int
    hi: int
    at: int


@dataclass
class RowInput:
    request_id: str
    token_ids: list[int]  # the row's new tokens
    start_pos: int  # position of token_ids[0] (= tokens already in the cache)
    slot: int  # GDN state slot
    block_ids: list[int]  # the request's KV pages, in token order
    is_decode: bool
    sample: bool  # produce the next token from this row's last position
    want_logits: bool = False
    params: SamplingParams | None = None  # set when sample
    num_draft: int = 0  # the last num_draft of token_ids are speculative drafts to verify
    next_token: int | None = None  # the known token after token_ids (a prompt chunk that does not sample)
    # MTP: drafts to propose for this row's next step (when it samples), by how many of its drafts
    # this step accepts (index a: emitted tokens - 1; one entry for a row without drafts)
    draft_depths: tuple[int, ...] = ()
    prompt_logprobs: int | None = None  # set: logits at every position of this prompt chunk (top-n kept)
    history: tuple[list[int], list[int]] | None = None  # (prompt, output) ids: penalties, logit_bias, min_tokens
    num_output: int = 0  # new tokens the request has before this row samples (seeded sampling)
    # images (engine/vision/positions.py): the row's 3-D rotary positions where it covers a prompt
    # with images ([t, h, w] lists), else positions + rope_delta; the image tokens it covers
    mrope: list[list[int]] | None = None
    rope_delta: int = 0
    images: tuple[ImageSpan, ...] = ()


@dataclass
class SnapshotCopy:
    """A prefix snapshot copy (engine/cache/prefix.py): entry `index` of the snapshot pool <-> GDN
    state slot `slot`, and its partial KV page <-> page `page` (None: the prefix ends on a page
    boundary). A save's `offset` None takes the slot's state after the step (the prefix ends with
    the row); k: the forward writes the state after the row's first k tokens (a prefix that ends
    inside a prefill row, kernels/points.py), and only the page is copied after it. With MTP,
    `last` is the prefix's last position p - 1: a save keeps the main model's hidden state there,
    a restore hands it to the drafter, which computes its KV at p - 1 again with the request's
    own token p (docs/ARCHITECTURE.md "Prefix caching with MTP drafting"). `back`: a finished
    request's save whose accepted drafts ran past its stop token: the state (and hidden state)
    that many tokens before the last step's row ended, from the verification's per-token states."""

    index: int
    slot: int
    page: int | None = None
    offset: int | None = None
    last: int | None = None
    back: int = 0


@dataclass
class DraftFill:
    """A finished request's positions whose MTP pass the drafter deferred (engine/model/mtp.py,
    `pending`: its draft depth was 0), computed before its final snapshot is copied, so that the
    snapshot's tail page holds the drafter's KV as a drafting request's does. block_ids: its pages
    up to the tail page (the positions attend to the ones before)."""

    request_id: str
    block_ids: list[int]


@dataclass
class StepInput:
    rows: list[RowInput]  # decode rows first
    finished_ids: list[str] = field(default_factory=list)
    restores: list[SnapshotCopy] = field(default_factory=list)  # into slots and pages, before the forward
    saves: list[SnapshotCopy] = field(default_factory=list)  # from slots and pages, after the forward
    # requests whose last prompt chunk is in this step and whose state a transfer takes layer by
    # layer: each rank's LayerConnector hears of every layer as the forward finishes it
    layer_posts: list[str] = field(default_factory=list)
    # decode side: states landed from a prefill node, saved from their slots before the forward
    landed: list[SnapshotCopy] = field(default_factory=list)
    # every row is a plain decode row (engine/model/graphs.py plain_decode), known where the rows
    # were built: the worker skips checking each row again
    plain: bool = False
    # the rows are the last step's (the same RowInput objects where the engine runs in-process), every
    # one a token further on: a plain step after a plain step over the same requests in the same
    # order (engine/step_input.py advance). Workers update what they kept from the last step instead
    # of building it again (docs/engine.md, "The persistent decode batch")
    steady: bool = False
    # a step without rows: finished requests' deferred MTP positions, computed before the saves
    fills: list[DraftFill] = field(default_factory=list)


@dataclass
class StepOutput:
    sampled: dict[str, list[int]]  # emitted tokens per sampling row (1, or up to k+1 when verifying drafts)
    logits: dict[str, object] = field(default_factory=dict)  # request id -> [vocab] float32 tensor
    drafts: dict[str, list[int]] = field(default_factory=dict)  # MTP drafts for each sampling row's next step
    # params.logprobs: (token, logprob, top) per emitted token (engine.sampling.TokenLogprob)
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # params.prompt_logprobs: (position of the row's first token, [PromptLogprob of the token after each position])
    prompt_logprobs: dict[str, tuple[int, list[PromptLogprob]]] = field(default_factory=dict)
    seconds: float = 0.0
    images: tuple[int, float, int] = (0, 0.0, 0)  # this step: images encoded, their seconds, encoder-cache hits

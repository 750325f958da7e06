"""The scheduler's typed records: one step's plan (`SchedulerOutput` of `ScheduledRow`s, with the
prefix snapshots it restores and saves; `StepPlan` while it is built) and a finished request's final-state save (`FinalSave`).
EngineCore turns a plan into the workers' `StepInput` (engine/step.py) and hands it back to
`Scheduler.update` (or `abandon`) once the step ran (or failed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.cache.prefix import Snapshot
from engine.request import Request
from engine.scheduler.priority import INTERACTIVE
from engine.step import DraftFill, SnapshotCopy, StepInput


@dataclass(slots=True)
class ScheduledRow:
    request: Request
    num_new_tokens: int  # drafts included
    draft_token_ids: list[int] = field(default_factory=list)
    # MTP: the request's draft depth after this step, by how many of its drafts it accepts (index
    # a; one entry when it carries none), so the worker drafts for the next step what it will
    # verify and defers the MTP pass of a request whose depth is about to drop to 0
    draft_depths: tuple[int, ...] = ()
    # both fixed when the row is planned (the request's computed tokens move only after the step)
    # Continues a sequence with its one pending token (plus drafts): the recurrent path.
    is_decode: bool = field(init=False)
    # This row reaches the end of the known tokens, so it produces the next one.
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        r, known = self.request, self.num_new_tokens - len(self.draft_token_ids)
        self.is_decode = known == 1 and r.num_computed_tokens > 0
        self.samples = r.num_computed_tokens + known == r.num_tokens


@dataclass
class SchedulerOutput:
    rows: list[ScheduledRow]  # decode rows first (ordered by slot), then prefill chunks
    preempted: list[Request]
    finished_ids: list[str]  # finished since the last step (workers drop their per-request state)
    restores: list[tuple[Snapshot, SnapshotCopy]] = field(default_factory=list)  # prefix hits, pinned
    saves: list[tuple[Snapshot, SnapshotCopy]] = field(default_factory=list)  # snapshots this step writes
    # decode side: states landed from a prefill node, saved before the forward (PrefixPlanner.keep_landed)
    landed: list[tuple[Snapshot, SnapshotCopy]] = field(default_factory=list)
    # snapshots (saved now or earlier) whose prompt logprobs a request with them computes this step
    logprob_points: list[tuple[Snapshot, Request]] = field(default_factory=list)
    # the last step's rows again, each a plain decode row (Scheduler._steady): no prompt chunk
    steady: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.rows)


class StepPlan:
    """One step's plan while `Scheduler.schedule` builds it (its rows, preemptions and snapshot
    copies become the `SchedulerOutput`)."""

    def __init__(self, budget: int, short: int = 0) -> None:
        self.budget = budget  # tokens left in the step
        self.batch_left = 0  # prompt tokens batch requests may still take (set at their turn)
        self.short_cap = short  # SchedulerConfig.short_step_tokens (0: none) ...
        self.short_left = short  # ... and what short prompts may still take
        self.rows: list[ScheduledRow] = []
        self.plain = 0  # rows planned by `_running_rows`' first test (one token, room in its pages)
        self.preempted: list[Request] = []
        self.restores: list[tuple[Snapshot, SnapshotCopy]] = []
        self.saves: list[tuple[Snapshot, SnapshotCopy]] = []
        self.points: list[tuple[Snapshot, Request]] = []

    def urgent(self) -> bool:
        """An interactive prompt chunk is in the step: batch prompts wait for the next."""
        return any(not r.is_decode and r.request.params.priority == INTERACTIVE for r in self.rows)


@dataclass
class FinalSave:
    """A finished request's state kept for a snapshot at its last computed token: the slot and
    the partial page (None: it ends on a page boundary) are freed once the copy ran."""

    snapshot: Snapshot
    copy: SnapshotCopy
    # MTP at draft depth 0: the drafter's deferred positions, run before the copy (their pages
    # before the tail page are held until then, and freed with it)
    fill: DraftFill | None = None


def final_step(saves: list[FinalSave]) -> StepInput:
    """The executor call that copies finished requests' final states: no rows, their deferred
    MTP positions computed first."""
    return StepInput([], saves=[f.copy for f in saves], fills=[f.fill for f in saves if f.fill is not None])

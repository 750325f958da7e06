"""A request's states inside one engine (WAITING, RUNNING, PREEMPTED, HELD, RESERVED, FINISHED,
ABORTED) and the one table of moves between them, the disaggregated states included;
`Request.move` checks every change of state against it. Diagram: docs/engine.md, "Request states"."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType


class Status(enum.Enum):
    WAITING = "waiting"  # queued, never admitted (or held back for an in-flight sharer's snapshot)
    RUNNING = "running"  # in the batch: computing its prompt or decoding
    PREEMPTED = "preempted"  # queued again with nothing allocated; recomputes prompt + output
    HELD = "held"  # prefill side: prompt computed, first token sampled, memory kept for the push
    RESERVED = "reserved"  # decode side: memory set aside for a state another node is writing
    FINISHED = "finished"  # stopped (stop token, EOS, max_tokens, max_model_len or a full cache) or pushed
    ABORTED = "aborted"  # cancelled, or its transfer abandoned

    @property
    def is_final(self) -> bool:
        """No further move: the request's memory is released."""
        return self in FINAL

    @property
    def is_queued(self) -> bool:
        """In the scheduler's waiting queue."""
        return self in (Status.WAITING, Status.PREEMPTED)


FINAL = frozenset({Status.FINISHED, Status.ABORTED})  # Status.is_final
_S = Status
# The allowed moves: a request created WAITING (`Scheduler.add`) or moved straight to RESERVED
# (`Scheduler.reserve`, decode side) goes only where this table says.
TRANSITIONS: Mapping[Status, frozenset[Status]] = MappingProxyType(
    {
        _S.WAITING: frozenset({_S.RUNNING, _S.RESERVED, _S.ABORTED}),
        _S.RUNNING: frozenset({_S.PREEMPTED, _S.HELD, _S.FINISHED, _S.ABORTED}),
        _S.PREEMPTED: frozenset({_S.RUNNING, _S.ABORTED}),
        _S.HELD: frozenset({_S.FINISHED, _S.ABORTED}),
        _S.RESERVED: frozenset({_S.RUNNING, _S.ABORTED}),
        _S.FINISHED: frozenset(),
        _S.ABORTED: frozenset(),
    }
)


class TransitionError(RuntimeError):
    """A move the table does not allow: a bug in the caller, not a bad request."""


def check_transition(request_id: str, src: Status, dst: Status) -> None:
    """Raise TransitionError unless `src` -> `dst` is in TRANSITIONS."""
    allowed = TRANSITIONS[src]
    if dst not in allowed:
        to = ", ".join(sorted(s.value for s in allowed)) or "nothing: it is final"
        raise TransitionError(
            f"request {request_id!r}: {src.value} -> {dst.value} is not allowed (from {src.value}: {to})"
        )

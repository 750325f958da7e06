"""The long lists of a step's rows, sent to tensor-parallel ranks as what they gained since the
last step: a row's KV page list and, for a sampler that needs them, its prompt and output ids;
and a row's sampling parameters once, KEPT after that.
Pickled whole, they made every step cost O(context) on the engine and on each rank (a step of
64 rows at 32k tokens each: milliseconds a step for the pages alone, many times that for the
ids; docs/benchmarks.md, "Tensor-parallel step overhead (CPU)").

Between two steps a row's lists only grow: the scheduler appends pages and tokens, and replaces a
list object (admission, preemption) rather than rewrite it. So where a row sends the same list
object it sent in the last step that had rows, at least as long as then, only the tail travels
(a tail); the rank appends it to the list it kept, which it then hands on as the row's own. Any
other list travels whole. Both sides keep exactly the lists of the last step that had rows."""

from __future__ import annotations

from engine.step import RowInput, StepInput

# On the wire a list field may hold a tail: (start, items), the items the list gained past index
# start (its length at the last send); a list field never holds a tuple otherwise. A row's
# sampling parameters (frozen) may be KEPT: the object the last step sent for that request, so a
# JSON schema or a logit_bias table is not pickled again each step.
KEPT = "kept"


def _tail(prev: object, n: int, items: list[int]) -> list[int] | tuple[int, list[int]]:
    return (n, items[n:]) if prev is items and n <= len(items) else items


class ListSender:
    """The engine's side: `swap_in` replaces the rows' lists by what travels, `swap_out` puts the
    rows' own lists back once the step is pickled (the engine keeps using its rows), and keeps
    what was sent only if it was (`sent`)."""

    def __init__(self) -> None:
        # per request of the last step sent with rows: (pages, their length, prompt, its length,
        # output, its length, parameters), None where the row had none
        self._sent: dict[str, tuple] = {}
        self._next: dict[str, tuple] | None = None
        self._saved: list[tuple[RowInput, list[int], tuple[list[int], list[int]] | None, object]] = []

    def swap_in(self, step: StepInput) -> None:
        if not step.rows:  # a step of snapshot copies alone: the lists stay as they were
            return
        last = self._sent
        now: dict[str, tuple] = {}
        saved = self._saved = []
        self._next = now
        for r in step.rows:
            pages, history, params = r.block_ids, r.history, r.params
            saved.append((r, pages, history, params))
            e = last.get(r.request_id)
            prompt, output = history if history is not None else (None, None)
            now[r.request_id] = (pages, len(pages), prompt, len(prompt or ()), output, len(output or ()), params)
            if e is None:
                continue
            # RowInput's fields are typed as what the engine gives them, not the wire's forms
            r.block_ids = _tail(e[0], e[1], pages)  # type: ignore[assignment]
            if prompt is not None and output is not None:
                r.history = (_tail(e[2], e[3], prompt), _tail(e[4], e[5], output))  # type: ignore[assignment]
            if params is not None and e[6] is params:
                r.params = KEPT  # type: ignore[assignment]

    def swap_out(self, sent: bool) -> None:
        """The rows' own lists back; `sent`: the step was pickled, the ranks will hold its lists."""
        for r, pages, history, params in self._saved:
            r.block_ids, r.history, r.params = pages, history, params  # type: ignore[assignment]
        if sent and self._next is not None:
            self._sent = self._next
        self._saved, self._next = [], None


class ListReceiver:
    """A rank's side: `restore` turns a received step's tails back into whole lists (the ones it
    kept, grown) and KEPT back into the parameters, in place."""

    def __init__(self) -> None:
        self._held: dict[str, tuple] = {}  # per request of the last step: (pages, prompt, output, parameters)

    def restore(self, step: StepInput) -> StepInput:
        if not step.rows:
            return step
        last, now = self._held, {}
        for r in step.rows:
            e = last.get(r.request_id)
            pages = r.block_ids = _whole(e, 0, r.block_ids)
            if isinstance(r.params, str):  # KEPT
                assert e is not None
                r.params = e[3]
            prompt = output = None
            if r.history is not None:
                prompt, output = r.history = (_whole(e, 1, r.history[0]), _whole(e, 2, r.history[1]))
            now[r.request_id] = (pages, prompt, output, r.params)
        self._held = now
        return step


def _whole(e: tuple | None, i: int, got: list[int] | tuple[int, list[int]]) -> list[int]:
    """The list a field carried: itself, or (a tail) the one kept in e[i], grown."""
    if not isinstance(got, tuple):
        return got
    start, items = got
    kept = e[i] if e is not None else None
    if kept is None or len(kept) != start:
        raise RuntimeError(f"step lists out of step: a list of {len(kept or ())} items, the engine sent from {start}")
    kept += items
    return kept

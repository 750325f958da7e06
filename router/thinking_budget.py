"""A thinking budget (`thinking_token_budget`, vLLM's name; Anthropic's `thinking.budget_tokens`)
as an output constraint, so the nodes enforce it with the grammar mask they already apply
(engine/structured): when the prompt leaves a think block open, the output is at most N tokens
of thinking text, then `</think>` (the only token allowed once N are out), then the answer,
free or following the request's own constraint (a JSON schema, a tool call, ...), which then
starts right after `</think>` as it does without a budget (docs/api.md)."""

from __future__ import annotations

from proto import pb
from router.structured_fields import as_lark


def constrain(c: pb.Constraint | None, think_close: int, budget: int) -> pb.Constraint:
    """The constraint of a request whose prompt opened a think block: thinking of at most
    `budget` tokens, `</think>` (id `think_close`), then `c`'s answer (its start_after_token,
    `</think>`, is implied by the grammar's order)."""
    think = f"think[max_tokens={budget}]: /(?s:.*)/\n" if budget > 0 else ""
    start = f"start: {'think ' if budget > 0 else ''}<[{think_close}]> answer\n"
    return pb.Constraint(grammar=start + think + f"answer: {as_lark(c)}\n")

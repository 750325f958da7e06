"""Structured outputs: a request's Constraint (spec.py), the llguidance grammar it compiles to
(grammar.py), a structural tag as a Lark grammar (struct_tag.py), the per-request matcher that follows the emitted tokens (matcher.py) and the
per-step batch bitmask the sampler applies (bitmask.py)."""

from engine.structured.spec import KINDS, Constraint

__all__ = ["KINDS", "Constraint"]

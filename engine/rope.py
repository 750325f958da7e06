"""Rotary position scaling as checkpoints write it (`rope_parameters`, or the older `rope_scaling`):
the rotary frequencies, the factor cos and sin are multiplied by, and the context the scaling
gives. Types: `default`; `linear` (positions divided by the factor); `yarn` (YaRN, Peng et al.
2023: each frequency interpolated by the factor, extrapolated, or blended between the two by how
many turns it makes over the original context, and cos / sin scaled by 0.1 ln(factor) + 1).
Anything else is refused in one line naming the type (docs/engine.md, "Long contexts")."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the router reads configs without torch (tests/router/test_cache_aware.py)
    import torch

SUPPORTED = ("default", "linear", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    kind: str = "default"
    factor: float = 1.0
    original_max_positions: int | None = None  # the context the checkpoint was trained at (yarn)
    beta_fast: float = 32.0  # yarn: frequencies with more turns than this over the original context keep their value
    beta_slow: float = 1.0  # ... with fewer than this are interpolated by the factor
    attention_factor: float = 1.0  # cos and sin are multiplied by this
    truncate: bool = True  # yarn: the blend's bounds rounded outwards to whole dimensions

    @classmethod
    def from_text(cls, text: dict) -> RopeScaling:
        """From a text config, as transformers reads it: its `rope_parameters` (or, in older
        configs, `rope_scaling`), with YaRN's original context defaulting to the config's
        `original_max_position_embeddings` beside them, else its max_position_embeddings."""
        return cls.parse(
            text.get("rope_parameters"),
            text.get("rope_scaling"),
            text.get("max_position_embeddings"),
            text.get("original_max_position_embeddings"),
        )

    @classmethod
    def parse(
        cls,
        rope: dict | None,
        legacy: dict | None = None,
        max_positions: int | None = None,
        original: int | None = None,
    ) -> RopeScaling:
        """From a text config's `rope_parameters` (or, in older configs, `rope_scaling`).
        max_positions, original: the config's max_position_embeddings and a top-level
        original_max_position_embeddings, where YaRN's parameters name no original context (the
        top-level one wins, as in transformers)."""
        p = dict(legacy or {})
        p.update({k: v for k, v in (rope or {}).items() if v is not None or k == "factor"})
        kind = p.get("rope_type", p.get("type", "default"))
        if kind not in SUPPORTED:
            raise ValueError(f"unsupported rope_type {kind!r}; supported: {', '.join(SUPPORTED)}")
        if kind == "default":
            return cls()
        if "factor" not in p:  # transformers refuses it too; taking 1 would drop the scaling unseen
            raise ValueError(f"rope {kind} needs factor, a number >= 1")
        orig = original if original is not None else p.get("original_max_position_embeddings", max_positions)
        if kind == "yarn" and (not isinstance(orig, int) or orig <= 0):
            raise ValueError(f"rope yarn needs original_max_position_embeddings, a positive integer (got {orig!r})")
        factor = p["factor"]
        if factor is None and kind == "yarn" and max_positions and isinstance(orig, int):
            factor = max_positions / orig  # DeepSeek-V3's form: the ratio of the two contexts
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not factor >= 1.0:
            raise ValueError(f"rope {kind} factor must be a number >= 1 (got {factor!r})")
        factor = float(factor)
        if kind == "linear":
            return cls(kind, factor)
        att = p.get("attention_factor")
        if att is None:
            mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
            att = _mscale(factor, mscale) / _mscale(factor, mscale_all) if mscale and mscale_all else _mscale(factor)
        return cls(
            kind,
            factor,
            orig,
            float(p.get("beta_fast") or 32.0),
            float(p.get("beta_slow") or 1.0),
            float(att),
            bool(p.get("truncate", True)),
        )

    def max_positions(self, max_position_embeddings: int) -> int:
        """The context this scaling serves: the original context times the factor where the config
        names it, never less than max_position_embeddings."""
        if self.kind == "yarn" and self.original_max_positions is not None:
            return max(max_position_embeddings, int(self.original_max_positions * self.factor))
        return max_position_embeddings

    def positions_source(self, max_position_embeddings: int) -> str:
        """Where `max_positions` comes from, for an error that names it."""
        n = self.max_positions(max_position_embeddings)
        if self.kind == "yarn" and n > max_position_embeddings:
            return f"original_max_position_embeddings {self.original_max_positions} x yarn factor {self.factor:g}"
        return f"max_position_embeddings {max_position_embeddings}"

    def inv_freq(self, rotary_dim: int, theta: float) -> torch.Tensor:
        """[rotary_dim / 2] float32 rotary frequencies."""
        import torch

        base = theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
        extrapolated = 1.0 / base
        if self.kind == "default":
            return extrapolated
        interpolated = 1.0 / (self.factor * base)
        if self.kind == "linear":
            return interpolated
        assert self.original_max_positions is not None
        lo = _turns_dim(self.beta_fast, rotary_dim, theta, self.original_max_positions)
        hi = _turns_dim(self.beta_slow, rotary_dim, theta, self.original_max_positions)
        if self.truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, rotary_dim - 1)
        if lo == hi:
            hi += 0.001
        # 0 below lo (keep the frequency), 1 above hi (interpolate it), linear between
        ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
        return interpolated * ramp + extrapolated * (1 - ramp)


NO_SCALING = RopeScaling()


def _mscale(factor: float, m: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _turns_dim(turns: float, dim: int, theta: float, context: int) -> float:
    """The (fractional) rotary dimension whose frequency makes `turns` full turns over `context`
    positions."""
    return dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(theta))

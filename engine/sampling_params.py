"""SamplingParams: how one request picks its tokens and when it stops."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True, init=False)
class SamplingParams:
    max_tokens: int = 16  # new tokens at most (finish reason "length")
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 keeps all
    top_p: float = 1.0  # keep the smallest set whose probability reaches top_p
    seed: int | None = None  # same seed, same tokens, whatever else is in the batch
    stop_token_ids: tuple[int, ...] = ()  # finish (reason "stop") after emitting one of these
    ignore_eos: bool = False  # keep going past the model's end-of-sequence tokens

    def __init__(self, **kwargs):
        names = {f.name for f in fields(self)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown sampling option(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        for f in fields(self):
            object.__setattr__(self, f.name, kwargs.get(f.name, f.default))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self._check()

    def _check(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer (got {self.max_tokens!r})")
        if not isinstance(self.temperature, (int, float)) or not (0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be in [0, 100] (got {self.temperature!r})")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer (got {self.top_k!r})")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p!r})")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer (got {self.seed!r})")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers (got {list(self.stop_token_ids)!r})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        return cls(**d)

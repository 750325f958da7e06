"""SamplingParams: how one request picks its tokens and when it stops."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from numbers import Integral, Real

from engine.sampling_vllm import check_output_options, stop_strings, vllm_forms
from engine.structured.spec import Constraint

MAX_LOGPROBS = 20  # most alternatives per position (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 300  # most logit_bias entries (OpenAI's limit)
LOGIT_BIAS_RANGE = 100.0  # a bias is in [-this, this]
MAX_CACHE_SALT = 1024  # characters
GREEDY_BELOW = 1e-5  # a temperature below this samples greedily (vLLM's _SAMPLING_EPS): logits / t stay finite


@dataclass(frozen=True, init=False)
class SamplingParams:
    max_tokens: int = 16  # new tokens at most (finish reason "length")
    temperature: float = 1.0  # 0 (and anything below GREEDY_BELOW) means greedy
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 keeps all
    top_p: float = 1.0  # keep the smallest set whose probability reaches top_p
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one (before top-k, top-p)
    seed: int | None = None  # same seed, same tokens, whatever else is in the batch
    stop_token_ids: tuple[int, ...] = ()  # finish (reason "stop") after emitting one of these
    ignore_eos: bool = False  # keep going past the model's end-of-sequence tokens
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many new tokens
    # Penalties (docs/api.md), applied to the logits after logit_bias, before temperature and the filters:
    presence_penalty: float = 0.0  # minus this for every token already in the output
    frequency_penalty: float = 0.0  # minus this times the token's count in the output
    repetition_penalty: float = 1.0  # logits of prompt or output tokens: positive / it, negative * it
    # token id -> bias in [-100, 100] added to its logit before the penalties (-100 all but bans
    # it, 100 all but forces it); given as a mapping, kept as (id, bias) pairs sorted by id
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # per new token: its log-probability and the n most likely (0..20)
    prompt_logprobs: int | None = None  # per prompt token after the first: the same (0..20)
    # speculative decoding: drafts per step at most for this request (0: none), not above the
    # server's num_speculative_tokens (EngineCore.validate); None: the server's
    num_speculative_tokens: int | None = None
    # structured output (engine/structured): the drawn tokens are masked so the output follows it;
    # given as a Constraint or a {kind, value, start_after_token} mapping
    constraint: Constraint | None = None
    # scheduling class (engine/scheduler/batching.py): 0 interactive, 1 batch; waiting interactive
    # prompts are scheduled first and batch prompts get short chunks while interactive ones are about
    priority: int = 0
    # prefix-cache isolation (docs/prefix-caching.md): a request shares cached prompt state only
    # with requests of the same salt; "" shares with every other request without one
    cache_salt: str = ""
    # vLLM's output options, applied by the offline LLM (engine/llm_text.py; the engine core reads
    # none of them, and the served route carries its own: docs/api.md)
    n: int = 1  # completions per prompt (seeded: seed + i for the i-th)
    stop: tuple[str, ...] = ()  # the text ends before the first of these (finish "stop")
    include_stop_str_in_output: bool = False  # the matched stop string stays at the text's end
    skip_special_tokens: bool = True  # special tokens are left out of the text
    spaces_between_special_tokens: bool = True  # vLLM's; a fast tokenizer's text is the same either way
    detokenize: bool = True  # False: no text (token ids only)

    def __init__(self, **kwargs):
        kwargs = vllm_forms(kwargs)
        names = {f.name for f in fields(self)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown sampling option(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        for f in fields(self):
            object.__setattr__(self, f.name, kwargs.get(f.name, f.default))
        object.__setattr__(self, "stop", stop_strings(self.stop))
        object.__setattr__(self, "stop_token_ids", _stop_ids(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        object.__setattr__(self, "constraint", Constraint.from_value(self.constraint))
        self._check()

    def _check(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer (got {self.max_tokens!r})")
        if not isinstance(self.temperature, (int, float)) or not (0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be in [0, 100] (got {self.temperature!r})")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer (got {self.top_k!r})")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p!r})")
        if not isinstance(self.min_p, (int, float)) or isinstance(self.min_p, bool) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (got {self.min_p!r})")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer (got {self.seed!r})")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative integer (got {self.min_tokens!r})")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (got {v!r})")
        rp = self.repetition_penalty
        if not isinstance(rp, (int, float)) or isinstance(rp, bool) or not 0.0 < rp <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10] (got {rp!r})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] (got {v!r})")
        v = self.num_speculative_tokens
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ValueError(f"num_speculative_tokens must be a non-negative integer (got {v!r})")
        if self.priority not in (0, 1) or isinstance(self.priority, bool):
            raise ValueError(f"priority must be 0 (interactive) or 1 (batch) (got {self.priority!r})")
        if not isinstance(self.cache_salt, str) or len(self.cache_salt) > MAX_CACHE_SALT:
            raise ValueError(f"cache_salt must be a string of at most {MAX_CACHE_SALT} characters")
        check_output_options(self)
        if self.constraint is not None and self.min_tokens:
            raise ValueError(
                "min_tokens cannot be combined with a constraint: the grammar decides where the output ends"
            )
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers (got {list(self.stop_token_ids)!r})")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
        for t, b in self.logit_bias:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids (got {t!r})")
            if not isinstance(b, float) or not math.isfinite(b) or abs(b) > LOGIT_BIAS_RANGE:
                lim = LOGIT_BIAS_RANGE
                raise ValueError(f"logit_bias values must be numbers in [-{lim:g}, {lim:g}] (got {b!r} for token {t})")

    @property
    def biased(self) -> bool:
        return bool(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1.0

    @property
    def speculates(self) -> bool:
        """Whether speculative decoding may draft for this request: always but with
        num_speculative_tokens 0. Penalties, logit_bias, min_tokens and logprobs apply at every
        draft position as if the drafts before it were emitted (engine/sampling/adjust.py)."""
        return self.num_speculative_tokens != 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["logit_bias"] = dict(self.logit_bias)
        d["stop"] = list(self.stop)
        d["constraint"] = self.constraint.to_dict() if self.constraint else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        return cls(**d)


def _stop_ids(ids) -> tuple:
    """stop_token_ids as a tuple, numpy / torch integers as ints; a non-list is refused here, its
    entries by _check (EngineCore.validate refuses ids outside the model's vocabulary)."""
    if ids is None:
        return ()
    if isinstance(ids, (str, bytes, Mapping)) or not isinstance(ids, (list, tuple, set, frozenset)):
        raise ValueError(f"stop_token_ids must be a list of token ids (integers) (got {ids!r})")
    return tuple(int(t) if isinstance(t, Integral) and not isinstance(t, bool) else t for t in ids)


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """A mapping (or (id, bias) pairs) -> pairs sorted by id; bool and non-numbers are left for
    _check to refuse by name."""
    if bias is None:
        return ()
    if isinstance(bias, Mapping):
        items = list(bias.items())
    elif isinstance(bias, (list, tuple)) and all(isinstance(e, (list, tuple)) and len(e) == 2 for e in bias):
        items = [tuple(e) for e in bias]
    else:
        raise ValueError(f"logit_bias must map token ids to biases (got {type(bias).__name__})")
    try:
        dup = len({t for t, _ in items}) != len(items)
    except TypeError:
        raise ValueError("logit_bias keys must be non-negative token ids") from None
    if dup:
        raise ValueError("logit_bias names a token id more than once")
    out = []
    for t, b in items:  # numpy / torch scalars too
        if isinstance(t, Integral) and not isinstance(t, bool):
            t = int(t)
        if isinstance(b, Real) and not isinstance(b, bool):
            b = float(b)
        out.append((t, b))
    try:
        return tuple(sorted(out))
    except TypeError:  # mixed key types: _check names the bad one
        return tuple(out)

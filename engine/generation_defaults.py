"""Default sampling parameters from a checkpoint's generation_config.json, as vLLM applies them
(its `--generation-config` and `--override-generation-config`): a request that leaves one of
these unset gets the model's value instead of the neutral default (docs/api.md, "Default
sampling parameters").

- `auto` (the default): the checkpoint's own generation_config.json;
- `vllm` (vLLM's name for none) or `none`: the neutral defaults (temperature 1, no top-k / top-p);
- a directory: the generation_config.json in it.

Read as transformers 5 reads the file (GenerationConfig.to_diff_dict): every value it holds is the
model's, a neutral one (temperature 1.0, top_k 50) too. The keys taken are vLLM's: temperature, top_k, top_p, min_p, repetition_penalty, and max_new_tokens as max_tokens
(a cap: a request asking for more gets this many). The override, a JSON object of those keys,
wins over the file and applies with `vllm` too. Imports no torch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.json_text import json_value

MODES = ("auto", "vllm", "none")
HELP = (
    "default sampling parameters of requests that leave them unset: auto (the checkpoint's "
    "generation_config.json, as vLLM), vllm or none (temperature 1, no top-k / top-p), or a directory "
    "holding a generation_config.json"
)
OVERRIDE_HELP = (
    "a JSON object over those defaults (vLLM's --override-generation-config), keys temperature, top_k, "
    'top_p, min_p, repetition_penalty, max_new_tokens, e.g. \'{"temperature": 0.7, "top_p": 0.8}\''
)
# generation_config.json key -> SamplingParams field
KEYS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
_INTS = ("top_k", "max_new_tokens")


def defaults(model: str | None, mode: str = "auto", override: str | dict | None = None) -> dict[str, float | int]:
    """SamplingParams field -> the default a request without it gets ({} for none); ValueError,
    one line, for a mode, file or override that cannot be read."""
    mode = mode or "auto"
    if mode in ("vllm", "none"):
        found: dict[str, Any] = {}
    else:
        where = model if mode == "auto" else mode
        found = {} if where is None else _from_file(Path(where), mode)
    found.update(_override(override))
    out: dict[str, float | int] = {}
    for key, field in KEYS.items():
        v = found.get(key)
        if v is None:
            continue
        out[field] = _checked(key, v)
    from engine.sampling_params import SamplingParams  # noqa: PLC0415 (its ranges, checked once at start)

    try:
        SamplingParams(**out)
    except ValueError as e:
        raise ValueError(f"the default sampling parameters ({describe(out)}): {e}") from None
    return out


def _from_file(where: Path, mode: str) -> dict[str, Any]:
    if mode != "auto" and not where.is_dir():
        raise ValueError(
            f"--generation-config {mode!r}: not auto, vllm, none or a directory holding generation_config.json"
        )
    path = where / "generation_config.json"
    if not path.is_file():
        if mode != "auto":
            raise ValueError(f"--generation-config {mode!r}: the directory has no generation_config.json")
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not readable as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return {k: v for k, v in data.items() if k in KEYS and v is not None}


def _override(value: str | dict | None) -> dict[str, Any]:
    if value is None or value == "":
        return {}
    over = json_value(value, "--override-generation-config")
    if not isinstance(over, dict):
        raise ValueError(f"--override-generation-config must be a JSON object (got {over!r:.60})")
    unknown = sorted(set(over) - set(KEYS))
    if unknown:
        raise ValueError(
            f"--override-generation-config: {', '.join(unknown)} not taken; the keys are {', '.join(KEYS)}"
        )
    return dict(over)


def _checked(key: str, v: Any) -> float | int:
    """A value of the right type (the engine's SamplingParams checks its range per request)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"generation config {key}: a number, not {v!r:.40}")
    if key in _INTS:
        if v != int(v):
            raise ValueError(f"generation config {key}: an integer, not {v!r}")
        return int(v)
    return float(v)


def describe(d: dict[str, float | int]) -> str:
    """One log line's worth: `temperature 0.6, top_k 20, top_p 0.95`, or "none"."""
    return ", ".join(f"{k} {v:g}" for k, v in d.items()) or "none"

"""`--hf-overrides` (vLLM's name): a JSON object deep-merged into a checkpoint's config.json, as the
nodes, their tensor-parallel ranks (they get the config the node read), the router and `pdserve up`'s
checks all read it, so a YaRN context is served without editing the checkpoint (docs/engine.md,
"Long contexts").

Objects merge key by key, at any depth; any other value (a list, a number, null) replaces what the
checkpoint has. Two rules keep an override of the rotary positions from being dropped unseen:

- `rope_scaling` and `rope_theta` are older spellings of entries of `rope_parameters`: where the
  checkpoint's text config has `rope_parameters`, they are merged into it (its own `rope_type` and
  `rope_theta` would otherwise win over them), `rope_scaling`'s `type` as `rope_type`;
- in a vision-language checkpoint (its text model under `text_config`, the wrapper reading no
  rotary settings of its own), `rope_parameters`, `rope_scaling` and `rope_theta` at the top of the
  override, where config.json has none at its top, are the text model's.

vLLM's removed `--rope-scaling JSON` and `--rope-theta N` are read as `--hf-overrides
'{"rope_scaling": JSON}'` and `'{"rope_theta": N}'` (router/vllm_flags.py). Imports no torch."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from engine.json_text import json_value

FLAG = "--hf-overrides"
HELP = (
    "a JSON object merged into the checkpoint's config.json (objects key by key; vLLM's --hf-overrides), e.g. "
    '\'{"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144}}\''
)
ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta")
T = TypeVar("T")
P = ParamSpec("P")


def parse(value: str | dict | None, where: str = FLAG) -> dict[str, Any]:
    """The override as a dict ({} for None or ""); ValueError, one line naming `where`, for text
    that is not JSON or JSON that is not an object."""
    if value is None or value == "":
        return {}
    value = json_value(value, where)
    if not isinstance(value, dict):
        raise ValueError(f'{where} must be a JSON object, such as {{"rope_theta": 1000000}} (got {value!r:.60})')
    return value


def text(value: str | dict | None, where: str = FLAG) -> str | None:
    """The override as the option holds it: compact JSON text of an object (None for none)."""
    over = parse(value, where)
    return json.dumps(over, separators=(",", ":")) if over else None


def merge(base: dict, over: dict) -> dict:
    """`base` with `over` merged in: objects key by key, at any depth; other values replace. New dicts."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def apply(raw: dict, over: dict) -> dict:
    """config.json's `raw` with the override `over` merged in, the rotary keys placed as the module
    docstring says."""
    if not over:
        return raw
    over = dict(over)
    text_raw = raw.get("text_config")
    if not isinstance(text_raw, dict):
        return merge(raw, _rope_placed(raw, over))
    top = {k: over.pop(k) for k in ROPE_KEYS if k in over and k not in raw}
    inner = over.get("text_config", {})
    if isinstance(inner, dict):
        over["text_config"] = _rope_placed(text_raw, merge(top, inner))
    else:  # text_config replaced by a non-object: config.json's reader says what is wrong
        over.update(top)
    return merge(raw, over)


def _rope_placed(text_raw: dict, over: dict) -> dict:
    """A text config's override with `rope_scaling` / `rope_theta` moved into `rope_parameters`
    where the checkpoint's text config has that."""
    if not isinstance(text_raw.get("rope_parameters"), dict):
        return over
    over = dict(over)
    params: dict[str, Any] = {}
    legacy = over.get("rope_scaling")
    if isinstance(legacy, dict):
        del over["rope_scaling"]
        params.update(legacy)
        if "type" in legacy and "rope_type" not in legacy:
            params["rope_type"] = legacy["type"]
    if "rope_theta" in over:
        params["rope_theta"] = over.pop("rope_theta")
    if not params:
        return over
    given = over.get("rope_parameters")
    over["rope_parameters"] = merge(params, given) if isinstance(given, dict) else params
    return over


def read_config(path: str | os.PathLike, overrides: str | dict | None) -> tuple[Path, dict]:
    """(config.json's path, its content with `overrides` merged in)."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"no config.json in {path}: pass a checkpoint directory written by save_pretrained")
    raw = json.loads(cfg_path.read_text())
    return cfg_path, apply(raw, parse(overrides))


def one_line_errors(read: Callable[P, T]) -> Callable[P, T]:
    """`ModelConfig.from_dir(cls, path, ..., hf_overrides=...)` with a missing key or a value of the
    wrong kind in the config (a checkpoint's own or an override's) as one ValueError naming the file,
    not a stack trace."""

    @functools.wraps(read)
    def wrapped(*args: P.args, **kwargs: P.kwargs) -> T:
        over = kwargs.get("hf_overrides")
        parse(over if isinstance(over, str | dict) else None)  # the override itself: its own line
        try:
            return _numbers_checked(read(*args, **kwargs))
        except ValueError as e:  # the reader's own line, saying the override had a part in it
            raise ValueError(f"{e} (config.json with {FLAG})") if kwargs.get("hf_overrides") else e from None
        except (KeyError, TypeError, AttributeError) as e:
            where = Path(str(args[1])) / "config.json"  # args: (cls, path, ...)
            with_over = f" with {FLAG}" if kwargs.get("hf_overrides") else ""
            what = f"no {e.args[0]!r}" if isinstance(e, KeyError) else str(e)
            raise ValueError(f"cannot read {where}{with_over}: {what}") from None

    return wrapped


# ModelConfig's fields that config.json names otherwise
CONFIG_NAMES = {"num_kv_heads": "num_key_value_heads", "mtp_num_layers": "mtp_num_hidden_layers"}


def _numbers_checked(m: T) -> T:
    """`m` (a ModelConfig), or TypeError naming the first size or number config.json gave as
    something else (null, text): it would fail later, in a node, with a stack trace."""
    import dataclasses

    for f in dataclasses.fields(m):  # type: ignore[arg-type]
        v, want = getattr(m, f.name), f.type  # the annotation's text (`from __future__ import annotations`)
        if want not in ("int", "float"):
            continue
        ok = isinstance(v, int) if want == "int" else isinstance(v, int | float)
        if not ok or isinstance(v, bool):
            kind = "an integer" if want == "int" else "a number"
            raise TypeError(f"{CONFIG_NAMES.get(f.name, f.name)} must be {kind} (got {v!r:.40})")
    return m

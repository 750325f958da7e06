"""The prompts `LLM.generate` takes, in vLLM's forms, made token ids: `prompts=` a str, a
`{"prompt": str}` dict (vLLM's TextPrompt), a `{"prompt_token_ids": [int, ...]}` dict (its
TokensPrompt, which may also carry its text as "prompt"), either with vLLM's
`"multi_modal_data": {"image": image or [images]}` (engine/vision/prompt_images.py) and its
`"mm_processor_kwargs"` (the images' pixel bounds, engine/vision/size_kwargs.py), or a list
mixing them; or
`prompt_token_ids=` a list of token lists, or one prompt as a flat list of ints (vLLM's older
form). Numpy and torch integers count as ints. Anything else is a ValueError naming the prompt's
index and what was expected; the engine's own checks (vocabulary, length) come after."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from numbers import Integral
from typing import Any, NamedTuple

from engine.tokenizer import Tokenizer
from engine.vision.prompt_images import expand, images_of
from engine.vision.size_kwargs import size_bounds

EXPECTED = "a str, {'prompt': str} or {'prompt_token_ids': [int, ...]}"
KEYS = ("prompt", "prompt_token_ids", "multi_modal_data", "mm_processor_kwargs")


class Prompt(NamedTuple):
    token_ids: list[int]
    text: str | None  # the prompt's text where it was given as text (RequestOutput.prompt)
    images: list[Any] | None = None  # multi_modal_data's images, one per <|image_pad|> in the prompt
    image_kwargs: Any = None  # mm_processor_kwargs: the images' pixel bounds (engine/vision/size_kwargs.py)


def parse_prompts(prompts: Any, prompt_token_ids: Any, tokenizer: Tokenizer | None) -> list[Prompt]:
    if (prompts is None) == (prompt_token_ids is None):
        raise ValueError(
            f"give exactly one of prompts= ({EXPECTED}, or a list of them) or prompt_token_ids=[[int, ...], ...]"
        )
    if prompt_token_ids is not None:
        return _token_lists(prompt_token_ids)
    if isinstance(prompts, (str, Mapping)):
        prompts = [prompts]
    if isinstance(prompts, bytes) or not isinstance(prompts, Iterable):
        raise ValueError(f"prompts must be {EXPECTED}, or a list of them (got {type(prompts).__name__})")
    return [_prompt(i, p, tokenizer) for i, p in enumerate(prompts)]


def _prompt(i: int, p: Any, tokenizer: Tokenizer | None) -> Prompt:
    if isinstance(p, str):
        return Prompt(_encode(i, p, tokenizer), p)
    if not isinstance(p, Mapping):
        raise ValueError(f"prompt {i}: expected {EXPECTED} (got {type(p).__name__})")
    unknown = sorted(str(k) for k in p if k not in KEYS)
    if unknown:
        raise ValueError(f"prompt {i}: unknown key(s) {', '.join(unknown)}; expected {EXPECTED}")
    text = p.get("prompt")
    if text is not None and not isinstance(text, str):
        raise ValueError(f"prompt {i}: 'prompt' must be a str (got {type(text).__name__})")
    images = images_of(i, p["multi_modal_data"]) if p.get("multi_modal_data") is not None else None
    kw = p.get("mm_processor_kwargs")
    try:
        size_bounds(kw, None)  # its keys (the bounds are checked where the images are placed)
    except ValueError as e:
        raise ValueError(f"prompt {i}: {e}") from None
    if "prompt_token_ids" in p:
        return Prompt(_ids(i, p["prompt_token_ids"]), text, images, kw)
    if text is None:
        raise ValueError(f"prompt {i}: expected {EXPECTED} (got a dict without either key)")
    return Prompt(_encode(i, text, tokenizer), text, images, kw)


def expand_prompts(path: str, vision: Any, given: list[Prompt]) -> tuple[list[Prompt], list[tuple]]:
    """Prompts with multi_modal_data images: each <|image_pad|> expanded to its image's tokens, and
    per prompt its ImageInputs (LLM.generate's `images=`)."""
    out, imgs = [], []
    for i, p in enumerate(given):
        ids, placed = (
            expand(path, vision, i, p.token_ids, p.images, p.image_kwargs)
            if p.images is not None
            else (p.token_ids, ())
        )
        out.append(Prompt(ids, p.text))
        imgs.append(placed)
    return out, imgs


def _encode(i: int, text: str, tokenizer: Tokenizer | None) -> list[int]:
    if tokenizer is None:
        raise ValueError(
            f"prompt {i}: this checkpoint has no tokenizer.json: give token ids ({{'prompt_token_ids': [...]}})"
        )
    return tokenizer.encode(text)


def _token_lists(given: Any) -> list[Prompt]:
    given = _plain(given)
    if isinstance(given, (str, bytes, Mapping)) or not isinstance(given, Iterable):
        raise ValueError(f"prompt_token_ids must be a list of token-id lists (got {type(given).__name__})")
    given = list(given)
    if given and all(_is_id(t) for t in given):  # one prompt as a flat list of ints, as vLLM takes it
        return [Prompt(_ids(0, given), None)]
    return [Prompt(_ids(i, p), None) for i, p in enumerate(given)]


def _ids(i: int, p: Any) -> list[int]:
    p = _plain(p)
    if isinstance(p, (str, bytes, Mapping)) or not isinstance(p, Iterable):
        raise ValueError(f"prompt {i}: expected a list of token ids (got {type(p).__name__})")
    ids = list(p)
    if all(type(t) is int for t in ids):  # the common case, at C speed
        return ids
    for j, t in enumerate(ids):
        if not _is_id(t):
            raise ValueError(f"prompt {i}: token ids must be integers (got {t!r} at position {j})")
    return [int(t) for t in ids]


def _is_id(t: Any) -> bool:
    return isinstance(t, Integral) and not isinstance(t, bool)


def _plain(v: Any) -> Any:
    """A numpy array or torch tensor as nested Python lists of ints."""
    tolist = getattr(v, "tolist", None)
    return tolist() if callable(tolist) and not isinstance(v, (list, tuple)) else v

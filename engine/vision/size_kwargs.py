"""A request's `mm_processor_kwargs` (vLLM's field, on the router's chat requests and the offline
`LLM`'s prompts): the image processor's pixel bounds for that request's images, `min_pixels` /
`max_pixels` or transformers' `size` {shortest_edge, longest_edge} (both keys, as the processor
requires; `min_pixels` / `max_pixels` win over them, as in the processor). `size_bounds` turns
them into (min_pixels, max_pixels) over the checkpoint's own, or None where they leave the
checkpoint's; anything else is a ValueError whose message names the key (the router's 400 on the
field). Imports nothing but the standard library (the router reads it without torch)."""

from __future__ import annotations

FIELD = "mm_processor_kwargs"
KEYS = ("min_pixels", "max_pixels", "size")
EDGES = ("shortest_edge", "longest_edge")
MOST = 2**32 - 1  # the node messages carry the bounds as uint32


def _count(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MOST:
        raise ValueError(f"{where} must be a positive integer (pixels) below 2^32, got {value!r:.40}")
    return value


def size_bounds(
    kwargs: object, own: tuple[int, int] | None, max_image_pixels: int | None = None, field: str = FIELD
) -> tuple[int, int] | None:
    """(min_pixels, max_pixels) for the request's images; None for none given (or the checkpoint's
    `own` bounds; `own` None: the model takes no images, only the keys are checked).
    `max_image_pixels`: the router's limit on an image's pixels, which min_pixels may not pass
    (the processor would scale a small image up to it); None: no limit. `field`: what the
    messages call the request's field."""
    if kwargs is None or kwargs == {}:
        return None
    if not isinstance(kwargs, dict):
        raise ValueError(f'{field} must be an object, such as {{"max_pixels": 1003520}}, got {kwargs!r:.60}')
    for key in kwargs:
        if key not in KEYS:
            raise ValueError(
                f"{field} key {key!r} is not supported: this server takes {', '.join(KEYS)} "
                "(the image processor's pixel bounds)"
            )
    if own is None:
        return None  # no images can come (an image is refused on its own)
    lo, hi = own
    size = kwargs.get("size")
    if size is not None:
        if not isinstance(size, dict) or set(size) != set(EDGES):
            raise ValueError(f"{field}.size must be an object with exactly shortest_edge and longest_edge (pixels)")
        lo = _count(size["shortest_edge"], f"{field}.size.shortest_edge")
        hi = _count(size["longest_edge"], f"{field}.size.longest_edge")
    if "min_pixels" in kwargs:
        lo = _count(kwargs["min_pixels"], f"{field}.min_pixels")
    if "max_pixels" in kwargs:
        hi = _count(kwargs["max_pixels"], f"{field}.max_pixels")
    if lo > hi:
        raise ValueError(f"{field}: min_pixels {lo} is above max_pixels {hi}")
    if max_image_pixels is not None and lo > max_image_pixels:
        raise ValueError(
            f"{field}: min_pixels {lo} is above this router's limit of {max_image_pixels} pixels an image "
            "(--max-image-pixels)"
        )
    return None if (lo, hi) == own else (lo, hi)

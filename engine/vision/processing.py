"""The checkpoint's own image processor (transformers' AutoImageProcessor, from
preprocessor_config.json): the patch grid an image resizes to, and its pixel values."""

from __future__ import annotations

import functools
import hashlib
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from engine.vision.inputs import ImageInput, decode_rgb, hash_pixels, sized_hash

if TYPE_CHECKING:  # the nodes' RPC threads check images through here without torch
    import torch


@functools.lru_cache(maxsize=4)
def load_processor(path: str):
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: no image processor (preprocessor_config.json) for the vision model: {e}") from None


def own_bounds(path: str) -> tuple[int, int]:
    """The processor's own (min_pixels, max_pixels): its `size` {shortest_edge, longest_edge}."""
    size = dict(load_processor(path).size)
    return int(size["shortest_edge"]), int(size["longest_edge"])


def grid_of(path: str, width: int, height: int, bounds: tuple[int, int] | None = None) -> tuple[int, int, int]:
    """The (t, h, w) patch grid the processor resizes a width x height image to, within its own
    pixel bounds or `bounds` (min_pixels, max_pixels: a request's mm_processor_kwargs)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    p = load_processor(path)
    lo, hi = bounds or own_bounds(path)
    h, w = smart_resize(height, width, p.patch_size * p.merge_size, lo, hi)
    return 1, h // p.patch_size, w // p.patch_size


def _size(img: ImageInput) -> dict[str, object]:
    """The processor call's keyword for the image's own bounds ({} for the checkpoint's)."""
    if img.size_bounds is None:
        return {}
    return {"size": {"shortest_edge": img.size_bounds[0], "longest_edge": img.size_bounds[1]}}


_CHECKED: OrderedDict[bytes, None] = OrderedDict()  # images that passed check_image, by content
_CHECKED_MAX = 256
_LOCK = threading.Lock()  # RPC threads and the engine loop check images at once


def check_image(path: str, k: int, img: ImageInput) -> None:
    """Image k's bytes decode, hash to its pixel_hash and resize to its grid (ValueError). An image
    that passed once (the same bytes, hash and grid) passes again at the cost of a hash of its
    bytes: a node checks in its RPC thread first, and the engine loop's check is then that hash."""
    bounds = b"" if img.size_bounds is None else repr(img.size_bounds).encode()
    key = hashlib.blake2b(
        img.data + img.pixel_hash + bytes(img.grid_thw) + bounds + path.encode(), digest_size=16
    ).digest()
    with _LOCK:
        if key in _CHECKED:
            _CHECKED.move_to_end(key)
            return
    _check(path, k, img)  # outside the lock: decoding takes a while
    with _LOCK:
        _CHECKED[key] = None
        if len(_CHECKED) > _CHECKED_MAX:
            _CHECKED.popitem(last=False)


def _check(path: str, k: int, img: ImageInput) -> None:
    try:
        rgb = decode_rgb(img.data)
    except Exception as e:  # PIL raises several kinds on bad bytes
        raise ValueError(f"image {k}: cannot decode its bytes ({type(e).__name__}: {e})") from None
    if sized_hash(hash_pixels(rgb), img.size_bounds) != img.pixel_hash:
        what = (
            "its decoded pixels" if img.size_bounds is None else f"its decoded pixels and size bounds {img.size_bounds}"
        )
        raise ValueError(f"image {k}: pixel_hash is not the SHA-256 of {what}")
    try:
        grid = grid_of(path, rgb.width, rgb.height, img.size_bounds)
    except ValueError as e:
        raise ValueError(f"image {k}: {e}") from None
    if grid != tuple(img.grid_thw):
        raise ValueError(f"image {k}: grid_thw {list(img.grid_thw)} is not the processor's {list(grid)}")


def pixel_values(path: str, img: ImageInput) -> torch.Tensor:
    """[t*h*w, patch_dim] float32: the processor's patches of one image."""
    got = load_processor(path)(images=[decode_rgb(img.data)], return_tensors="pt", **_size(img))
    grid = tuple(int(x) for x in got["image_grid_thw"][0])
    if grid != tuple(img.grid_thw):
        raise ValueError(f"image grid {list(grid)} is not the request's {list(img.grid_thw)}")
    return got["pixel_values"]

"""What the router needs to know of a checkpoint's vision side (`VisionSpec.load`): whether it has
a vision tower, its image placeholder token, and its image processor's resize rule, read from
`config.json` and the processor config saved beside it. `grid` gives an image's patch grid
(t, h, w) from its size alone, by the rule transformers' Qwen2-VL image processor applies (both
sides a multiple of patch x merge, the pixel count within [min_pixels, max_pixels], the aspect
ratio kept as closely as that allows), so the router builds no pixel tensor."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("pdserve.router")

IMAGE_PAD = "<|image_pad|>"  # the template renders one per image; the router expands it
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"  # what a text prompt holds per image
MAX_ASPECT = 200  # the processor refuses images whose long side is more than this times the short one
# The image processors whose resize rule `grid` follows (transformers' names, saved and loaded)
PROCESSORS = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")


@dataclass(frozen=True)
class VisionSpec:
    image_token_id: int  # <|image_pad|>
    patch_size: int = 14  # the processor's defaults, as transformers' Qwen2-VL processor has them
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    def __post_init__(self) -> None:
        if min(self.patch_size, self.temporal_patch_size, self.merge_size, self.min_pixels) < 1:
            raise ValueError(f"the image processor's sizes must be positive: {self}")
        if self.max_pixels < self.min_pixels:
            raise ValueError(f"the image processor's max_pixels {self.max_pixels} < min_pixels {self.min_pixels}")

    @classmethod
    def load(cls, ckpt: str | Path, pad_id: int | None, overrides: str | None = None) -> VisionSpec | None:
        """The checkpoint's vision spec; None when it takes no images (no `vision_config`, no image
        processor config, or a processor whose resize rule this router does not know). `pad_id`:
        the tokenizer's id of <|image_pad|>, checked against config.json's image_token_id (with
        --hf-overrides merged in, as the nodes read it: engine/config_overrides.py)."""
        from engine.config_overrides import apply, parse

        d = Path(ckpt)
        cfg = apply(_read(d / "config.json"), parse(overrides))
        if not isinstance(cfg.get("vision_config"), dict):
            return None
        proc = _read(d / "preprocessor_config.json")
        nested = _read(d / "processor_config.json").get("image_processor")
        if not proc and isinstance(nested, dict):  # newer transformers nest it in the processor's config
            proc = nested
        kind = proc.get("image_processor_type")
        if kind not in PROCESSORS:
            log.warning("%s: image processor %r is not one the router knows (%s): images refused", d, kind, PROCESSORS)
            return None
        token = cfg.get("image_token_id", pad_id)
        if pad_id is None or token != pad_id:
            log.warning(
                "%s: config.json's image_token_id %s is not the tokenizer's %s: images refused", d, token, pad_id
            )
            return None
        size = proc.get("size")
        sizes = size if isinstance(size, dict) else {}
        kw: dict[str, int] = {}
        for name, key in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            v = proc.get(name, sizes.get(key))  # top-level min_pixels / max_pixels win, as in the processor
            if isinstance(v, int):
                kw[name] = v
        for name in ("patch_size", "temporal_patch_size", "merge_size"):
            v = proc.get(name)
            if isinstance(v, int):
                kw[name] = v
        return cls(image_token_id=pad_id, **kw)

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) the processor resizes an image to; ValueError past MAX_ASPECT."""
        if max(width, height) > MAX_ASPECT * min(width, height):
            raise ValueError(
                f"its aspect ratio {max(width, height) / min(width, height):.0f}:1 is beyond {MAX_ASPECT}:1"
            )
        f = self.patch_size * self.merge_size
        h, w = round(height / f) * f, round(width / f) * f
        if h * w > self.max_pixels:
            scale = math.sqrt(height * width / self.max_pixels)
            h = max(f, math.floor(height / scale / f) * f)
            w = max(f, math.floor(width / scale / f) * f)
        elif h * w < self.min_pixels:
            scale = math.sqrt(self.min_pixels / (height * width))
            h = math.ceil(height * scale / f) * f
            w = math.ceil(width * scale / f) * f
        return w, h

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """The patch grid (t, h, w) before the merge of an image of this size (t is 1 for an image)."""
        w, h = self.resized(width, height)
        return 1, h // self.patch_size, w // self.patch_size

    def num_tokens(self, grid: tuple[int, int, int]) -> int:
        """Placeholder tokens an image of this grid takes in the prompt: one per merged patch."""
        t, h, w = grid
        return t * h * w // (self.merge_size * self.merge_size)


def _read(p: Path) -> dict[str, object]:
    if not p.is_file():
        return {}
    v = json.loads(p.read_text())
    return v if isinstance(v, dict) else {}

"""A request's image state where the engine admits it: the images checked against the prompt
(and, where it is prefilled, their bytes decoded, hashed and sized by the processor), its 3-D
rotary positions and position offset (engine/vision/positions.py); and the prefix-cache view
of a prompt whose images are not known here."""

from __future__ import annotations

import os

import torch

from engine.config import ModelConfig
from engine.vision.inputs import ImageInput
from engine.vision.positions import check_images, mrope_positions
from engine.vision.processing import check_image


def image_state(
    cfg: ModelConfig, prompt: list[int], images: tuple[ImageInput, ...], pixels: bool
) -> tuple[tuple[ImageInput, ...], torch.Tensor | None, int]:
    """(images, [3, len(prompt)] positions or None, rope_delta); ValueError for images that do
    not fit the prompt or the model."""
    v = cfg.vision
    if not images:
        if v is not None and v.image_token_id in prompt and pixels:
            check_images(prompt, images, v.image_token_id, v.spatial_merge_size)  # names the uncovered pads
        return (), None, 0
    if v is None:
        raise ValueError("this model does not take images (its checkpoint has no vision tower)")
    if not all(isinstance(i, ImageInput) for i in images):
        raise ValueError("images must be ImageInput records (engine/vision/inputs.py)")
    check_images(prompt, images, v.image_token_id, v.spatial_merge_size)
    if pixels:
        for k, img in enumerate(images):
            check_image(cfg.path, k, img)
    pos, delta = mrope_positions(len(prompt), images, v.spatial_merge_size)
    return images, pos, delta


def unknown_images_view(cfg: ModelConfig, prompt: list[int]) -> list[int] | None:
    """A reserved prompt with image placeholders but no images given: its prefix-cache view with
    the placeholders marked by a value of its own, so it shares no page or snapshot with any
    other prompt (None: no placeholders, the plain view)."""
    v = cfg.vision
    if v is None or v.image_token_id not in prompt:
        return None
    mark = (int.from_bytes(os.urandom(8), "little") >> 1) | (1 << 62)
    return [mark if t == v.image_token_id else t for t in prompt]

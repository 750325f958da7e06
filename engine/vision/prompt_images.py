"""vLLM's multimodal prompt for the offline `LLM`: `{"prompt": ..., "multi_modal_data": {"image":
image or [images]}}`, each image a PIL image (or its encoded bytes), its place in the prompt one
`<|image_pad|>` (Qwen's `<|vision_start|><|image_pad|><|vision_end|>`), as vLLM's Qwen-VL prompts
write it. `expand` turns such a prompt into what the router would hand a node: each
`<|image_pad|>` repeated to the image's placeholder tokens (its patch grid from the checkpoint's
image processor, within the prompt's `mm_processor_kwargs` pixel bounds where it gives them:
engine/vision/size_kwargs.py), and each image as an `ImageInput` (PNG bytes of its RGB pixels and
their hash).
"""

from __future__ import annotations

import io
from typing import Any

from engine.vision.config import VisionConfig
from engine.vision.inputs import ImageInput, decode_rgb, hash_pixels, sized_hash, to_rgb
from engine.vision.processing import grid_of, own_bounds
from engine.vision.size_kwargs import size_bounds


def images_of(i: int, data: Any) -> list[Any]:
    """A prompt's `multi_modal_data`: {"image": image or [image, ...]} -> the images (ValueError
    naming prompt i for another modality or a value that is not an image)."""
    if not isinstance(data, dict):
        raise ValueError(f"prompt {i}: 'multi_modal_data' must be a dict such as {{'image': image}}")
    other = sorted(str(k) for k in data if k != "image")
    if other:
        raise ValueError(f"prompt {i}: multi_modal_data {', '.join(other)} is not supported (images only: 'image')")
    imgs = data.get("image", [])
    imgs = list(imgs) if isinstance(imgs, (list, tuple)) else [imgs]
    for k, img in enumerate(imgs):
        if not (isinstance(img, (bytes, bytearray)) or hasattr(img, "getbands")):
            raise ValueError(
                f"prompt {i}: image {k} must be a PIL.Image or encoded image bytes (got {type(img).__name__})"
            )
    return imgs


def expand(
    path: str, vision: VisionConfig | None, i: int, ids: list[int], images: list[Any], kwargs: object = None
) -> tuple[list[int], tuple[ImageInput, ...]]:
    """ids with one <|image_pad|> per image -> ids with each expanded, and the images placed on
    them; `kwargs`: the prompt's mm_processor_kwargs."""
    if vision is None:
        raise ValueError(f"prompt {i}: this model does not take images")
    try:
        bounds = size_bounds(kwargs, own_bounds(path))
    except ValueError as e:
        raise ValueError(f"prompt {i}: {e}") from None
    pad = vision.image_token_id
    at = [j for j, t in enumerate(ids) if t == pad]
    if len(at) != len(images):
        raise ValueError(
            f"prompt {i}: {len(images)} image(s) for {len(at)} <|image_pad|> placeholder(s) in the prompt: "
            "write <|vision_start|><|image_pad|><|vision_end|> once per image, in order"
        )
    merge = vision.spatial_merge_size
    out: list[int] = []
    inputs = []
    prev = 0
    for j, img in zip(at, images):
        rgb = decode_rgb(bytes(img)) if isinstance(img, (bytes, bytearray)) else to_rgb(img)
        buf = io.BytesIO()
        rgb.save(buf, format="PNG")  # lossless: the node's decode hashes to the same pixels
        out += ids[prev:j]
        grid = grid_of(path, rgb.width, rgb.height, bounds)
        image = ImageInput(buf.getvalue(), sized_hash(hash_pixels(rgb), bounds), len(out), grid, bounds)
        inputs.append(image)
        out += [pad] * image.num_tokens(merge)
        prev = j + 1
    out += ids[prev:]
    return out, tuple(inputs)

"""One image in a prompt, as the router hands it to the node that prefills the prompt: the
client's encoded bytes, a hash of the decoded pixels (the identity the encoder cache and the
prefix cache key on), where its placeholder tokens start and its patch grid (docs/images.md).
`decode_rgb` (`upright`, `to_rgb`) and `hash_pixels` are the one definition of that decode and that hash;
`sized_hash` names an image sized by a request's own pixel bounds (mm_processor_kwargs)."""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["ImageInput", "decode_rgb", "hash_pixels", "hash_view", "sized_hash", "to_rgb", "upright"]


@dataclass(frozen=True)
class ImageInput:
    data: bytes  # the encoded image (PNG, JPEG, WebP, ...) as the client sent it
    # the image's identity, what every cache keys on (32 bytes): SHA-256 of the decoded RGB pixels
    # and their size; with size_bounds, `sized_hash` of that and the bounds
    pixel_hash: bytes
    offset: int  # index in prompt_token_ids of the image's first placeholder (<|image_pad|>) token
    grid_thw: tuple[int, int, int]  # patch grid (t, h, w) before the merge, from the processor's resize
    # (min_pixels, max_pixels) the request gave the image processor (mm_processor_kwargs); None: the
    # checkpoint's own (preprocessor_config.json)
    size_bounds: tuple[int, int] | None = None

    def num_tokens(self, merge_size: int) -> int:
        """Placeholder tokens the image takes in the prompt: one per merged patch."""
        t, h, w = self.grid_thw
        return t * h * w // (merge_size * merge_size)


def decode_rgb(data: bytes) -> Image.Image:
    """The image's first frame, turned upright, as RGB pixels (PIL raises on bytes it cannot
    decode), by `upright` and `to_rgb`."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        img.seek(0)
        return to_rgb(upright(img))


def upright(img: Image.Image) -> Image.Image:
    """A decoded image turned as its EXIF orientation says (a phone's portrait photo is stored
    sideways with an orientation tag), as vLLM and transformers' `load_image` turn the bytes they
    are sent; `img` itself when it has no such tag. The pixels are decoded first (PIL raises on
    bytes it cannot decode); an orientation that cannot be read leaves the image as stored."""
    from PIL import ImageOps

    img.load()
    try:
        if img.getexif().get(0x0112, 1) == 1:  # ExifTags.Base.Orientation: 1 is upright
            return img
        return ImageOps.exif_transpose(img)
    except Exception:  # a malformed EXIF block: PIL raises several kinds; the image is used as stored
        return img


def to_rgb(img: Image.Image) -> Image.Image:
    """An opened image's current frame as RGB pixels, the one conversion the router and the nodes
    hash and encode. Transparency is composited onto white, as the checkpoints' image processors
    (transformers' convert_to_rgb) and vLLM do: a transparent logo is seen on white, not on
    whatever its hidden pixels hold."""
    from PIL import Image

    if "A" not in img.getbands() and img.info.get("transparency") is None:
        return img.convert("RGB")
    rgba = img.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255)), rgba).convert("RGB")


def hash_pixels(img: Image.Image) -> bytes:
    """SHA-256 of (width, height, RGB bytes): equal for equal pixels, whatever the encoding."""
    rgb = img if img.mode == "RGB" else img.convert("RGB")
    h = hashlib.sha256()
    h.update(rgb.width.to_bytes(4, "little") + rgb.height.to_bytes(4, "little"))
    h.update(rgb.tobytes())
    return h.digest()


def sized_hash(pixel_hash: bytes, bounds: tuple[int, int] | None) -> bytes:
    """The identity of an image resized within `bounds` (min_pixels, max_pixels) rather than the
    checkpoint's own: SHA-256 of its pixel hash and the bounds, so the encoder cache, the prefix
    cache and the encode pool never give one sizing's embeddings to another; `pixel_hash` itself
    for None."""
    if bounds is None:
        return pixel_hash
    lo, hi = bounds
    return hashlib.sha256(b"size-bounds" + pixel_hash + lo.to_bytes(8, "little") + hi.to_bytes(8, "little")).digest()


def hash_view(prompt: list[int], images) -> list[int]:
    """The prompt with each image's placeholder tokens (the run of <|image_pad|> from its offset)
    replaced by one number from its pixel hash (63 bits, far above any vocabulary): what the prefix
    cache's page hashes and snapshot keys are computed over, so pages and GDN snapshots covering
    different images differ and the same image again is a hit. The router can name pages the same
    way for cache-aware routing."""
    out = list(prompt)
    for img in images:
        mark = (int.from_bytes(img.pixel_hash[:8], "little") >> 1) | (1 << 62)
        pad, i = prompt[img.offset], img.offset
        while i < len(prompt) and prompt[i] == pad:
            out[i] = mark
            i += 1
    return out

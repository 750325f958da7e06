"""Decoding one encoded image on the router (in a worker thread, never on the event loop): its
size is read from the header and checked against the pixel limit before any pixel is decoded,
then the first frame is decoded, turned upright by its EXIF orientation and converted to RGB
(engine/vision/inputs.py's `upright` and `to_rgb`, as the nodes decode it), and its identity is hashed from the
result (engine/vision/inputs.py's `hash_pixels`, the one definition the nodes share). Only the formats in FORMATS are opened: others (SVG, PDF, EPS, ...) are
refused before a decoder for them runs."""

from __future__ import annotations

import io
import struct
import warnings
from dataclasses import dataclass

from PIL import Image

from engine.vision.inputs import hash_pixels, to_rgb, upright

# What clients send (the JPEG decoder also opens cameras' MPO files); the processor sees the
# first frame as RGB whatever the format.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")


class ImageRefused(ValueError):
    """An image the router will not take; `reason` is the refusal counter's label."""

    def __init__(self, reason: str, msg: str):
        super().__init__(msg)
        self.reason = reason


@dataclass(frozen=True)
class Decoded:
    width: int
    height: int
    pixel_hash: bytes  # SHA-256 of (width, height, RGB bytes)


def decode(data: bytes, max_pixels: int) -> Decoded:
    """Decode `data` (ImageRefused: corrupt, too large, a format not in FORMATS)."""
    if not data:
        raise ImageRefused("corrupt", "the image is empty")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)  # past PIL's own limit: refused too
        try:
            with Image.open(io.BytesIO(data), formats=FORMATS) as im:
                width, height = im.size
                if width * height > max_pixels:
                    raise _too_large(width, height, max_pixels)
                im.seek(0)
                rgb = to_rgb(upright(im))  # as the nodes decode it (turned, alpha onto white): the hashes must agree
        except ImageRefused:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:  # raised by open: no size yet
            raise ImageRefused(
                "too_large", f"image is past the limit of {max_pixels / 1e6:g} megapixels ({e})"
            ) from None
        except Image.UnidentifiedImageError:
            raise ImageRefused("format", f"not an image in a format this server reads ({', '.join(FORMATS)})") from None
        except (OSError, ValueError, SyntaxError, EOFError, struct.error) as e:  # what PIL's decoders raise
            raise ImageRefused("corrupt", f"the image is corrupt or truncated ({e})") from None
    return Decoded(rgb.width, rgb.height, hash_pixels(rgb))  # upright: a turned photo's sides swap


def _too_large(width: int, height: int, limit: int) -> ImageRefused:
    return ImageRefused(
        "too_large",
        f"image is {width * height / 1e6:.1f} megapixels ({width}x{height}), the limit is {limit / 1e6:g} megapixels",
    )

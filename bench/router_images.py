"""What an image costs the router (not a test): `Images.prepare` (decode under the limits, hash,
grid) of encoded photos of a few sizes, one at a time and many at once through the router's
decoding threads; median ms per image and images/s. The event loop does no decoding: its share
per image is the hop to a thread and back.

    flock /tmp/pdserve-bench.lock python bench/router_images.py [--images 16] [--workers 2]"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = [("JPEG", 1024, 768), ("PNG", 1024, 768), ("JPEG", 1920, 1080), ("JPEG", 4032, 3024)]


def photo(fmt: str, w: int, h: int) -> bytes:
    """Smooth gradients plus noise (compresses like a photo, unlike pure noise)."""
    import numpy as np
    from PIL import Image

    g = np.random.default_rng(0)
    yy, xx = np.mgrid[0:h, 0:w]
    px = np.stack([xx * 255 / w, yy * 255 / h, (xx + yy) % 256], -1) + g.normal(0, 12, (h, w, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(px, 0, 255).astype("uint8")).save(buf, format=fmt, quality=90)
    return buf.getvalue()


async def run(args, spec) -> None:
    from prometheus_client import CollectorRegistry

    from router.images.config import ImageArgs
    from router.images.prepare import ImageRef, Images

    imgs = Images(ImageArgs(max_images_per_request=args.images), spec, CollectorRegistry(), args.workers, 1 << 30)
    for fmt, w, h in SIZES:
        data = photo(fmt, w, h)
        one = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            (p,) = await imgs.prepare([ImageRef("images[0]", data=data)])
            one.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await imgs.prepare([ImageRef(f"images[{i}]", data=data) for i in range(args.images)])
        many = time.perf_counter() - t0
        print(
            f"{fmt} {w}x{h} ({len(data) / 1e6:.2f} MB, grid {p.grid_thw}): one {statistics.median(one) * 1e3:.1f} ms; "
            f"{args.images} at once on {args.workers} threads {many * 1e3:.0f} ms = {args.images / many:.1f} images/s",
            flush=True,
        )
    imgs.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    from router.images.vision import VisionSpec

    # Qwen3.5's processor: patch 16, merge 2, 65,536 to 16,777,216 pixels (its preprocessor_config.json)
    spec = VisionSpec(image_token_id=0, patch_size=16, min_pixels=65536, max_pixels=16777216)
    asyncio.run(run(args, spec))


if __name__ == "__main__":
    main()

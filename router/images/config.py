"""ImageArgs: the router's limits on image inputs (how many per request, how large) and whether it
fetches `http(s)` image URLs itself, with that fetch's time, size and redirect limits. Options of
`pdserve router` and `pdserve up` (docs/images.md)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.options import option


@dataclass(frozen=True)
class ImageArgs:
    # 16: more than a chat of screenshots needs; each image is decoded once on the router and again
    # on the node that prefills it, so the count bounds both.
    max_images_per_request: int = option(16, "most images one request may carry; more are refused (400)")
    # 25 megapixels: a 24 MP camera photo passes; decoding one takes 75 MB of RGB on the router (one
    # per image-decoding thread at a time). The processor resizes to its own max_pixels anyway.
    max_image_pixels: int = option(
        25_000_000, "largest image, in pixels (width x height, read from its header before decoding); larger: 400"
    )
    allow_image_urls: bool = option(
        False,
        "fetch http(s) image URLs in requests (off: only data: URLs and bytes; on, the router makes requests to "
        "any address a client names, so keep it off on a router that faces untrusted clients)",
    )
    allow_private_image_urls: bool = option(
        False,
        "with --allow-image-urls, also fetch from loopback, private and link-local addresses (off: a URL whose host "
        "resolves to one, such as a cloud metadata endpoint, is refused)",
    )
    image_url_timeout_s: float = option(10.0, "seconds one image URL's fetch may take in all (with --allow-image-urls)")
    image_url_max_bytes: int = option(
        16 << 20, "largest image body fetched from a URL, in bytes (with --allow-image-urls)"
    )
    image_url_max_redirects: int = option(3, "redirects one image URL's fetch follows (with --allow-image-urls)")

    def check_images(self) -> None:
        if self.max_images_per_request < 0 or self.max_image_pixels < 1:
            raise ValueError("max_images_per_request must be >= 0 (0: no images) and max_image_pixels >= 1")
        if not self.image_url_timeout_s > 0 or self.image_url_max_bytes < 1 or self.image_url_max_redirects < 0:
            raise ValueError("image_url_timeout_s must be > 0, image_url_max_bytes >= 1, image_url_max_redirects >= 0")

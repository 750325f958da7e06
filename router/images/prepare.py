"""The router's image path for one request (`Images`): each image part's bytes (router/images/fetch.py),
decoded in a worker thread under the limits (router/images/decode.py), its grid from the checkpoint's
processor rule (router/images/vision.py), then, once the prompt is tokenized, each <|image_pad|>
expanded to the image's placeholder tokens (`expand`) with its offset recorded. A refused image is
an INVALID_ARGUMENT Abort (HTTP 400) naming the part, counted by reason; nothing reaches a node."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from prometheus_client import CollectorRegistry, Counter

from engine.vision.inputs import ImageInput, sized_hash
from engine.vision.size_kwargs import size_bounds
from proto import pb
from router.errors import Abort
from router.images.config import ImageArgs
from router.images.decode import ImageRefused, decode
from router.images.fetch import fetch_url, from_data_url
from router.images.vision import IMAGE_PAD, PLACEHOLDER, VisionSpec

REASONS = ("no_vision", "too_many", "video", "corrupt", "too_large", "format", "aspect", "url", "url_off", "count")


@dataclass(frozen=True)
class ImageRef:
    """An image part as a request names it: where (for messages), and its URL or its bytes."""

    where: str  # "messages[1].content[0]", "input[0].content[1]", "images[0]"
    url: str = ""  # data: or http(s)
    data: bytes = b""  # the encoded image (a gRPC ImagePart's bytes)


@dataclass(frozen=True)
class Prepared:
    """An image decoded and checked: its bytes go to the node that prefills the prompt."""

    where: str
    data: bytes
    pixel_hash: bytes  # its identity: engine/vision/inputs.py `sized_hash` of the pixels' hash and size_bounds
    grid_thw: tuple[int, int, int]
    size_bounds: tuple[int, int] | None = None  # the request's (min_pixels, max_pixels); None: the checkpoint's


class Images:
    """Image limits, decoding threads and counters of one router; `spec` None: the model takes no images."""

    def __init__(
        self, args: ImageArgs, spec: VisionSpec | None, registry: CollectorRegistry, workers: int, max_bytes: int
    ):
        self.args, self.spec = args, spec
        self.max_bytes = max_bytes  # the encoded bytes one request's images may total (the node messages carry them)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="image")
        self.images = Counter("pdserve_router_images", "Images accepted in requests", registry=registry)
        self.tokens = Counter(
            "pdserve_router_image_tokens", "Prompt tokens the accepted images expanded to", registry=registry
        )
        self.bytes = Counter("pdserve_router_image_bytes", "Encoded bytes of the accepted images", registry=registry)
        self.refused = Counter(
            "pdserve_router_images_refused", "Requests refused for an image part, by reason", ["reason"],
            registry=registry,
        )  # fmt: skip
        for r in REASONS:
            self.refused.labels(reason=r)

    def refuse(self, reason: str, msg: str) -> Abort:
        self.refused.labels(reason=reason).inc()
        return Abort(grpc.StatusCode.INVALID_ARGUMENT, msg)

    def size_bounds(self, kwargs: object) -> tuple[int, int] | None:
        """A request's mm_processor_kwargs as pixel bounds for its images (engine/vision/size_kwargs.py);
        ValueError naming the key."""
        return size_bounds(kwargs, self._own(), self.args.max_image_pixels)

    def _own(self) -> tuple[int, int] | None:
        return None if self.spec is None else (self.spec.min_pixels, self.spec.max_pixels)

    def request_bounds(self, request: pb.GenerateRequest) -> tuple[int, int] | None:
        """A gRPC GenerateRequest's image_size as pixel bounds (INVALID_ARGUMENT naming the field)."""
        if not request.HasField("image_size"):
            return None
        size = request.image_size
        kw = {k: getattr(size, k) for k in ("min_pixels", "max_pixels") if size.HasField(k)}
        try:
            return size_bounds(kw, self._own(), self.args.max_image_pixels, "image_size")
        except ValueError as e:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None

    async def prepare(self, refs: Sequence[ImageRef], bounds: tuple[int, int] | None = None) -> list[Prepared]:
        """Every image of a request decoded and checked, in order (Abort on the first refused);
        `bounds`: the request's own (min_pixels, max_pixels) for the processor's resize."""
        if not refs:
            return []
        if self.spec is None:
            raise self.refuse("no_vision", f"{refs[0].where}: this model does not take images")
        most = self.args.max_images_per_request
        if len(refs) > most:
            raise self.refuse(
                "too_many",
                f"{refs[most].where}: the request has {len(refs)} images, the limit is {most} (--max-images-per-request)",
            )
        tasks = [asyncio.ensure_future(self._one(r, bounds)) for r in refs]
        try:
            out = list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()
        total = 0
        for p in out:
            total += len(p.data)
            if total > self.max_bytes:
                raise self.refuse(
                    "too_large",
                    f"{p.where}: the request's images total more than {self.max_bytes:,} bytes (--max-body-bytes)",
                )
        return out

    async def _one(self, ref: ImageRef, bounds: tuple[int, int] | None) -> Prepared:
        loop = asyncio.get_running_loop()
        try:
            data = ref.data
            if not data:
                data = await self._bytes(ref.url)
            spec = self.spec
            assert spec is not None
            args = (ref.where, data, spec, self.args.max_image_pixels, bounds)
            return await loop.run_in_executor(self._pool, _decode, *args)
        except ImageRefused as e:
            raise self.refuse(e.reason, f"{ref.where}: {e}") from None

    async def _bytes(self, url: str) -> bytes:
        scheme = url.partition(":")[0].lower()
        if scheme == "data":
            if len(url) < 1 << 16:
                return from_data_url(url)
            return await asyncio.get_running_loop().run_in_executor(self._pool, from_data_url, url)
        if scheme not in ("http", "https"):
            raise ImageRefused("url", f"an image URL must be a data: URL (or http(s) where allowed), got {scheme!r}")
        if not self.args.allow_image_urls:
            raise ImageRefused(
                "url_off",
                "image URLs are not fetched by this router (it was started without --allow-image-urls): "
                "send the image as a data: URL",
            )
        t0, limit = time.monotonic(), self.args.image_url_timeout_s
        try:  # the fetch checks its own deadline; this one answers the client even if a read hangs
            return await asyncio.wait_for(asyncio.to_thread(fetch_url, url, self.args), limit + 1.0)
        except TimeoutError:
            raise ImageRefused(
                "url", f"fetching the image URL took longer than {limit:g} s ({time.monotonic() - t0:.1f} s)"
            ) from None

    def expand(self, ids: list[int], images: Sequence[Prepared]) -> tuple[list[int], list[ImageInput]]:
        """`ids` with each <|image_pad|> replaced by its image's placeholder tokens, and the images
        with their offsets; Abort unless the prompt holds exactly one <|image_pad|> per image. With
        no images and a model that takes them, a prompt must hold no <|image_pad|> (the node would
        find a placeholder with no image)."""
        spec = self.spec
        if spec is None:
            return ids, []
        pad = spec.image_token_id
        at = [i for i, t in enumerate(ids) if t == pad]
        if len(at) != len(images):
            what = images[0].where if images else "prompt"
            raise self.refuse(
                "count",
                f"{what}: the prompt holds {len(at)} {IMAGE_PAD} placeholder(s) for {len(images)} image(s): "
                f"give one {PLACEHOLDER} per image, in order (and no {IMAGE_PAD} in the text)",
            )
        out: list[int] = []
        inputs: list[ImageInput] = []
        prev = 0
        for pos, img in zip(at, images, strict=True):
            out += ids[prev:pos]
            inputs.append(ImageInput(img.data, img.pixel_hash, len(out), img.grid_thw, img.size_bounds))
            n = spec.num_tokens(img.grid_thw)
            out += [pad] * n
            prev = pos + 1
        out += ids[prev:]
        return out, inputs

    def accepted(self, inputs: Sequence[ImageInput]) -> None:
        """Count a request's images once it goes ahead."""
        if self.spec is None:
            return
        self.images.inc(len(inputs))
        self.tokens.inc(sum(i.num_tokens(self.spec.merge_size) for i in inputs))
        self.bytes.inc(sum(len(i.data) for i in inputs))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _decode(
    where: str, data: bytes, spec: VisionSpec, max_pixels: int, bounds: tuple[int, int] | None = None
) -> Prepared:
    d = decode(data, max_pixels)
    if bounds is not None:
        spec = dataclasses.replace(spec, min_pixels=bounds[0], max_pixels=bounds[1])
    try:
        grid = spec.grid(d.width, d.height)
    except ValueError as e:
        raise ImageRefused("aspect", f"the image processor refuses it: {e}") from None
    return Prepared(where, data, sized_hash(d.pixel_hash, bounds), grid, bounds)


def to_pb(inputs: Sequence[ImageInput]) -> list[pb.ImageInput]:
    """The images as the node messages carry them (bounds 0, 0: the checkpoint's own)."""
    return [
        pb.ImageInput(
            data=i.data,
            pixel_hash=i.pixel_hash,
            offset=i.offset,
            grid_thw=i.grid_thw,
            min_pixels=i.size_bounds[0] if i.size_bounds else 0,
            max_pixels=i.size_bounds[1] if i.size_bounds else 0,
        )
        for i in inputs
    ]

"""Images for the router's image tests: encoded test images (random, solid, huge, refused
formats), a checkpoint directory that holds only what the router reads (the tiny tokenizer, a
config.json with a vision tower's config, transformers' image processor config) and a loopback
HTTP server whose paths serve an image, a large body, a slow one and redirects."""

from __future__ import annotations

import base64
import http.server
import io
import json
import shutil
import threading
import time
from pathlib import Path

from PIL import Image

# The tiny VL processor's bounds (engine/tiny_model.py's defaults): 4 to 64 merged patches of 32 x 32
MIN_PIXELS, MAX_PIXELS = 32 * 32 * 4, 32 * 32 * 64


def encoded(width: int, height: int, seed: int = 0, fmt: str = "PNG", mode: str = "RGB") -> bytes:
    """An image of random pixels (mode RGB / RGBA / L / P), encoded."""
    import numpy as np

    g = np.random.default_rng(seed)
    px = g.integers(0, 256, (height, width, 3), dtype=np.uint8)
    im = Image.fromarray(px).convert(mode)
    buf = io.BytesIO()
    im.save(buf, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return buf.getvalue()


def solid(width: int, height: int) -> bytes:
    """A solid grey PNG of any size: a 50-megapixel one compresses to about 50 KB."""
    buf = io.BytesIO()
    Image.new("L", (width, height), 128).save(buf, format="PNG", compress_level=9)
    return buf.getvalue()


SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="64" height="64"><rect width="64" height="64"/></svg>'
PDF = b"%PDF-1.4\n1 0 obj << /Type /Catalog >> endobj\ntrailer << /Root 1 0 R >>\n%%EOF\n"


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def vl_router_dir(text_ckpt: str | Path, out: Path, patch: int = 16) -> str:
    """`out` with the tokenizer of `text_ckpt`, a config.json naming a vision tower and the
    <|image_pad|> id, and a preprocessor_config.json written by transformers' Qwen2-VL processor."""
    from tokenizers import Tokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (Path(text_ckpt) / name).is_file():
            shutil.copy(Path(text_ckpt) / name, out / name)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    cfg = json.loads((Path(text_ckpt) / "config.json").read_text())
    cfg.update(
        vision_config={"patch_size": patch, "spatial_merge_size": 2, "temporal_patch_size": 2},
        image_token_id=tok.token_to_id("<|image_pad|>"),
        vision_start_token_id=tok.token_to_id("<|vision_start|>"),
    )
    (out / "config.json").write_text(json.dumps(cfg))
    Qwen2VLImageProcessorPil(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, patch_size=patch, merge_size=2
    ).save_pretrained(out)
    return str(out)


class ImageServer:
    """A loopback HTTP server: /img.png (an image), /big (a body past a limit, with its
    Content-Length), /big-chunked (the same, no length), /slow (a byte a second), /hang (headers
    never sent), /loop (redirects to itself through /loop2), /hops/N (N redirects before /img.png),
    /missing (404). `hits` counts requests per path."""

    def __init__(self, image: bytes, big: int):
        self.image, self.big = image, big
        self.hits: dict[str, int] = {}
        server = self

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                p = self.path
                server.hits[p] = server.hits.get(p, 0) + 1
                if p == "/img.png":
                    return self._body(server.image)
                if p == "/big":
                    return self._body(b"\0" * server.big)
                if p == "/big-chunked":
                    self.send_response(200)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    chunk = b"\0" * 65536
                    try:
                        for _ in range(server.big // len(chunk) + 2):
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.write(b"0\r\n\r\n")
                    except OSError:
                        pass
                    return None
                if p == "/slow":
                    self.send_response(200)
                    self.send_header("Content-Length", "100")
                    self.end_headers()
                    try:
                        for _ in range(100):
                            self.wfile.write(b"x")
                            self.wfile.flush()
                            time.sleep(0.25)
                    except OSError:
                        pass
                    return None
                if p == "/hang":
                    time.sleep(30)
                    return None
                if p in ("/loop", "/loop2"):
                    return self._redirect("/loop2" if p == "/loop" else "/loop")
                if p.startswith("/hops/"):
                    n = int(p.rsplit("/", 1)[1])
                    return self._redirect(f"/hops/{n - 1}" if n > 1 else "/img.png")
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None

            def _body(self, data: bytes):
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except OSError:
                    pass

            def _redirect(self, to: str):
                self.send_response(302)
                self.send_header("Location", to)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

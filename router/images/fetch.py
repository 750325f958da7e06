"""An image part's bytes from its URL: a `data:` URL is decoded here; an `http(s)` one is fetched
only when the router was started with --allow-image-urls, in a worker thread, under a total time
limit, a size limit (a declared Content-Length past it is refused unread) and a redirect limit
(a redirect loop stops there), and only from public addresses unless --allow-private-image-urls.
Anything else is refused. Every refusal is an ImageRefused whose message says what to send
instead."""

from __future__ import annotations

import base64
import binascii
import http.client
import ipaddress
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from http.client import HTTPMessage
from typing import IO

from router.images.config import ImageArgs
from router.images.decode import ImageRefused

CHUNK = 1 << 16


def from_data_url(url: str) -> bytes:
    """The bytes of `data:[<media type>][;base64],<data>` (the image's media type, or none)."""
    head, sep, body = url.partition(",")
    if not sep:
        raise ImageRefused("corrupt", "a data: URL needs a ',' before its data")
    params = head[len("data:") :].split(";")
    media = params[0].strip().lower()
    if media and not media.startswith("image/") and media != "application/octet-stream":
        raise ImageRefused("format", f"a data: URL of media type {media!r} is not an image")
    if "base64" not in (p.strip().lower() for p in params[1:]):
        return urllib.parse.unquote_to_bytes(body)
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageRefused("corrupt", f"the data: URL's base64 is invalid ({e})") from None


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects come back as HTTPError: `fetch_url` follows them itself, counted."""

    def redirect_request(
        self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str, headers: HTTPMessage, newurl: str
    ) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirects())


def fetch_url(url: str, args: ImageArgs) -> bytes:
    """The body at an http(s) URL under args' limits (ImageRefused otherwise), following at most
    `args.image_url_max_redirects` redirects and none to a URL seen before. Blocking: run it off
    the event loop. `args.image_url_timeout_s` bounds each socket operation and, checked between
    reads, the whole fetch."""
    deadline = time.monotonic() + args.image_url_timeout_s
    seen = {url}
    while True:
        got = _get(url, args, deadline)
        if isinstance(got, bytes):
            return got
        nxt = urllib.parse.urljoin(url, got)
        if urllib.parse.urlsplit(nxt).scheme not in ("http", "https"):
            raise ImageRefused("url", f"the image URL redirects to {nxt[:200]!r}, not an http(s) URL")
        if nxt in seen:
            raise ImageRefused("url", f"the image URL redirects in a loop (back to {nxt[:200]})")
        if len(seen) > args.image_url_max_redirects:
            raise ImageRefused(
                "url",
                f"the image URL redirects more than {args.image_url_max_redirects} times (--image-url-max-redirects)",
            )
        seen.add(nxt)
        url = nxt


def check_host(url: str, args: ImageArgs) -> None:
    """Refuse a URL whose host resolves to a loopback, private, link-local or otherwise non-public
    address, unless args.allow_private_image_urls. (The connection resolves the name again: a DNS
    answer that changes in between is not caught; a proxy in front of the router is the stronger fence.)"""
    if args.allow_private_image_urls:
        return
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    try:
        infos = socket.getaddrinfo(
            host, parts.port or (443 if parts.scheme == "https" else 80), type=socket.SOCK_STREAM
        )
    except (OSError, UnicodeError) as e:
        raise ImageRefused("url", f"fetching the image URL failed: {host!r} does not resolve ({e})") from None
    for info in infos:
        ip = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if not ip.is_global or ip.is_multicast:
            raise ImageRefused(
                "url",
                f"the image URL's host {host!r} is a non-public address ({ip}): this router fetches public "
                "addresses only (--allow-private-image-urls)",
            )


def _get(url: str, args: ImageArgs, deadline: float) -> bytes | str:
    """One GET: the body, or the Location of a redirect."""
    if "@" in urllib.parse.urlsplit(url).netloc:  # urllib would read "user:pass@host" as a host and port
        raise ImageRefused(
            "url",
            "image URLs with credentials (user:password@host) are not fetched: send a URL "
            "the router can fetch without them, or the image as a data: URL",
        )
    check_host(url, args)
    limit = args.image_url_max_bytes
    req = urllib.request.Request(url, headers={"Accept": "image/*", "User-Agent": "pdserve-router"})
    try:
        with _OPENER.open(req, timeout=max(0.01, deadline - time.monotonic())) as resp:
            declared = resp.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise ImageRefused("url", f"the image URL's body is {int(declared):,} bytes, the limit is {limit:,}")
            out = bytearray()
            while chunk := resp.read1(CHUNK):
                out += chunk
                if len(out) > limit:
                    raise ImageRefused("url", f"the image URL's body is over the limit of {limit:,} bytes")
                if time.monotonic() > deadline:
                    raise _slow(args)
            return bytes(out)
    except ImageRefused:
        raise
    except urllib.error.HTTPError as e:
        where = e.headers.get("Location") if e.headers is not None else None
        if 300 <= e.code < 400 and where:
            return str(where)
        raise ImageRefused("url", f"fetching the image URL failed: HTTP {e.code} {e.reason}") from None
    except TimeoutError:
        raise _slow(args) from None
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:
        why = e.reason if isinstance(e, urllib.error.URLError) else e
        if isinstance(why, TimeoutError):
            raise _slow(args) from None
        raise ImageRefused("url", f"fetching the image URL failed: {why}") from None


def _slow(args: ImageArgs) -> ImageRefused:
    return ImageRefused("url", f"fetching the image URL took longer than {args.image_url_timeout_s:g} s")

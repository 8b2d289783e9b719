"""The images of chat messages: the URLs of ``image_url`` content parts as checked RGB pictures for the processor.

A part is ``{"type": "image_url", "image_url": {"url": ...}}`` (OpenAI's format). The server takes
``data:image/<png|jpeg|webp|gif|bmp>;base64,...`` URLs. It fetches ``http(s)://`` URLs only when started with
``--allow-image-urls``: a server that fetched any address a client names would let clients make it reach hosts
behind its firewall. Other schemes (``file:``, ``ftp:``, ...) are always refused.

Every image is checked before its pixels are decoded: at most ``max_bytes`` encoded (a fetch reads no more
than one byte past it), and a header announcing more than ``max_pixels`` is refused before ``load()``, so a
small file that decompresses to gigabytes costs only the header's read. Only the five formats above are ever
decoded, whatever the URL's media type says.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import http.client
import io
import re
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
SCHEME = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]{0,31}):")  # bounded: an error message may show it
MEDIA_TYPES = frozenset({*(f"image/{name.lower()}" for name in FORMATS), "image/jpg"})  # jpg: a common misspelling


class ImageError(ValueError):
    """An image the server refuses; the message names the image (its index in the request, from 0) and why."""


@dataclass(frozen=True)
class ImageLimits:
    """What the server takes of a request's images."""

    max_images: int = 8  # per request
    max_bytes: int = 10 * 2**20  # encoded size of one image
    max_pixels: int = 4096 * 4096  # width * height, as the header announces it
    allow_urls: bool = False  # fetch http(s) URLs (--allow-image-urls)
    fetch_timeout: float = 10.0  # seconds, per fetch


@dataclass(frozen=True)
class DecodedImage:
    """A checked picture, and a digest of it for caching: the same pixels give the same digest whatever the file
    format (a PNG and a lossless re-encoding of it), and any other pixels another."""

    image: Image.Image  # mode RGB; an animation's first frame
    digest: str  # sha256 hex of the size and the RGB pixels


def load_images(urls: Sequence[str], limits: ImageLimits) -> list[DecodedImage]:
    """The request's images, in order; refuses more than `limits.max_images` before reading any."""
    if len(urls) > limits.max_images:
        raise ImageError(f"the request has {len(urls)} images; this server takes at most {limits.max_images}")
    return [load_image(url, index, limits) for index, url in enumerate(urls)]


def load_image(url: str, index: int, limits: ImageLimits) -> DecodedImage:
    """Image `index` of the request from its URL (a base64 data URL, or http(s) when `limits.allow_urls`).

    Raises:
        ImageError: a scheme or media type the server does not take, bad base64, a failed fetch, an image over
            the limits, or bytes that are not one of the accepted formats.
    """
    scheme = SCHEME.match(url)
    scheme = scheme[1].lower() if scheme else ""
    if scheme == "data":
        data = _data_url_bytes(url, index)
    elif scheme in ("http", "https") and limits.allow_urls:
        data = _fetch(url, index, limits)
    elif scheme in ("http", "https"):
        raise ImageError(f"image {index}: this server takes images as data URLs only (data:image/png;base64,...); "
                         "it fetches http(s) URLs only when started with --allow-image-urls")
    else:
        what = f"URL scheme {scheme!r} is not supported" if scheme else "not a URL"
        raise ImageError(f"image {index}: {what}; send a data URL (data:image/png;base64,...)")
    if len(data) > limits.max_bytes:
        raise ImageError(f"image {index} is {len(data):,} bytes; this server takes at most {limits.max_bytes:,}")
    return _decode(data, index, limits)


def _data_url_bytes(url: str, index: int) -> bytes:
    """The payload of a ``data:image/...;base64,`` URL, strictly decoded."""
    header, comma, payload = url.partition(",")  # no regex over the payload: it may be megabytes
    if not comma:
        raise ImageError(f"image {index}: a data URL needs a comma before its payload")
    media, *params = header[len("data:"):].lower().split(";")
    media = media.strip()
    if media not in MEDIA_TYPES:
        raise ImageError(f"image {index}: media type {media[:50]!r} is not supported; send one of "
                         f"{', '.join(sorted(MEDIA_TYPES))}")
    if not params or params[-1].strip() != "base64":
        raise ImageError(f"image {index}: the data URL is not base64 (data:{media};base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ImageError(f"image {index}: the data URL's payload is not valid base64 ({error})") from None


def _fetch(url: str, index: int, limits: ImageLimits) -> bytes:
    """The body at `url`, reading at most one byte past `limits.max_bytes` (the caller refuses a longer one)."""
    shown = url if len(url) <= 200 else url[:200] + "..."
    try:
        with urllib.request.urlopen(url, timeout=limits.fetch_timeout) as response:
            return response.read(limits.max_bytes + 1)
    except (OSError, http.client.HTTPException, ValueError) as error:  # URLError, HTTPError, timeouts: OSErrors
        if isinstance(error, urllib.error.HTTPError):
            error.close()  # it holds the response, and its socket
        raise ImageError(f"image {index}: could not fetch {shown}: {error}") from None


def _decode(data: bytes, index: int, limits: ImageLimits) -> DecodedImage:
    """The RGB picture in `data`, its size checked from the header before the pixels are decoded."""
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as opened:  # reads the header only
            width, height = opened.size
            if width * height > limits.max_pixels:
                raise ImageError(f"image {index} is {width}x{height} ({width * height:,} pixels); this server "
                                 f"takes at most {limits.max_pixels:,} pixels")
            opened.load()  # an animation stays on its first frame
            image = opened.convert("RGB")
    except ImageError:
        raise
    except Image.DecompressionBombError as error:  # Pillow's own limit, checked in `open` (2 * MAX_IMAGE_PIXELS)
        raise ImageError(f"image {index} is too large: {error}") from None
    except (OSError, SyntaxError, ValueError) as error:
        raise ImageError(f"image {index}: not a readable {'/'.join(FORMATS)} image ({error})") from None
    digest = hashlib.sha256(f"{width}x{height}:".encode() + image.tobytes()).hexdigest()
    return DecodedImage(image=image, digest=digest)

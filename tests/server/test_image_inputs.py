"""The images of chat messages (server/http/images.py): data URLs decoded to RGB, digests that follow the pixels
and not the file format, every refusal an `ImageError` naming the image, and http(s) fetches only when allowed,
against a real HTTP server on a local socket."""

from __future__ import annotations

import base64
import io
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image, features

from hf_paged_cache.server.http.images import (
    DecodedImage,
    ImageError,
    ImageLimits,
    load_image,
    load_images,
)

LIMITS = ImageLimits()


def pattern(width: int = 32, height: int = 24) -> Image.Image:
    """An RGB picture with no two neighbouring pixels alike, so a transposed or shifted copy differs."""
    image = Image.new("RGB", (width, height))
    image.putdata([((7 * x) % 256, (11 * y) % 256, (x * y) % 256) for y in range(height) for x in range(width)])
    return image


def encode(image: Image.Image, fmt: str = "PNG", **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header announces `width` x `height` and whose pixel data is garbage: refused for its size
    only if the size is checked before the pixels are decoded."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", b"not zlib") + chunk(b"IEND", b"")


def refusal(url: str, limits: ImageLimits = LIMITS, index: int = 3) -> str:
    with pytest.raises(ImageError) as caught:
        load_image(url, index, limits)
    message = str(caught.value)
    assert f"image {index}" in message
    return message


# --- what loads ---------------------------------------------------------------------------------------------


def test_png_data_url_loads_as_rgb_with_its_pixels():
    picture = pattern()
    loaded = load_image(data_url(encode(picture)), 0, LIMITS)
    assert isinstance(loaded, DecodedImage)
    assert loaded.image.mode == "RGB"
    assert loaded.image.size == (32, 24)
    assert loaded.image.tobytes() == picture.tobytes()
    assert len(loaded.digest) == 64 and int(loaded.digest, 16) >= 0  # sha256 hex


@pytest.mark.parametrize("fmt, media, options", [
    ("BMP", "image/bmp", {}),
    pytest.param("WEBP", "image/webp", {"lossless": True}, marks=pytest.mark.skipif(
        not features.check("webp"), reason="Pillow built without WebP")),
])
def test_same_pixels_in_another_lossless_format_give_the_same_digest(fmt, media, options):
    picture = pattern()
    as_png = load_image(data_url(encode(picture)), 0, LIMITS)
    as_other = load_image(data_url(encode(picture, fmt, **options), media), 0, LIMITS)
    assert as_other.digest == as_png.digest


def test_other_pixels_give_another_digest():
    picture = pattern()
    changed = picture.copy()
    changed.putpixel((31, 23), (255, 255, 255))  # the last pixel only
    digests = {load_image(data_url(encode(image)), 0, LIMITS).digest for image in (picture, changed)}
    assert len(digests) == 2


def test_same_bytes_in_another_shape_give_another_digest():
    # 4x1 and 1x4 of the same four pixels: identical RGB bytes, different pictures
    wide, tall = Image.new("RGB", (4, 1)), Image.new("RGB", (1, 4))
    pixels = [(1, 2, 3), (4, 5, 6), (7, 8, 9), (10, 11, 12)]
    wide.putdata(pixels)
    tall.putdata(pixels)
    assert wide.tobytes() == tall.tobytes()
    assert load_image(data_url(encode(wide)), 0, LIMITS).digest != load_image(data_url(encode(tall)), 0, LIMITS).digest


@pytest.mark.parametrize("mode", ["RGBA", "P", "L", "LA"])
def test_other_modes_come_back_rgb(mode):
    source = pattern().convert(mode)
    loaded = load_image(data_url(encode(source)), 0, LIMITS)
    assert loaded.image.mode == "RGB"
    assert loaded.image.tobytes() == source.convert("RGB").tobytes()


def test_animated_gif_gives_its_first_frame():
    red, blue = Image.new("RGB", (8, 8), (255, 0, 0)), Image.new("RGB", (8, 8), (0, 0, 255))
    gif = encode(red, "GIF", save_all=True, append_images=[blue], duration=100, loop=0)
    assert Image.open(io.BytesIO(gif)).n_frames == 2
    loaded = load_image(data_url(gif, "image/gif"), 0, LIMITS)
    assert loaded.image.getpixel((4, 4)) == (255, 0, 0)


def test_jpeg_loads_with_its_size():
    loaded = load_image(data_url(encode(pattern(40, 30), "JPEG", quality=90), "image/jpeg"), 0, LIMITS)
    assert loaded.image.size == (40, 30) and loaded.image.mode == "RGB"


def test_load_images_keeps_the_order():
    first, second = pattern(), pattern().transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    loaded = load_images([data_url(encode(first)), data_url(encode(second))], LIMITS)
    assert [item.image.tobytes() for item in loaded] == [first.tobytes(), second.tobytes()]


# --- what is refused ----------------------------------------------------------------------------------------

PNG = encode(pattern())


@pytest.mark.parametrize("url, why", [
    ("data:image/png," + PNG.hex(), "not base64"),
    ("data:image/png;base64,!!!!" + base64.b64encode(PNG).decode(), "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(PNG).decode()[:-3], "not valid base64"),  # bad padding
    ("data:image/png;base64\n" + base64.b64encode(PNG).decode(), "comma"),
    (data_url(b"hello, not a picture"), "not a readable"),
    (data_url(PNG[: len(PNG) // 2]), "not a readable"),  # header fine, pixel data cut
    (data_url(encode(pattern(), "TIFF"), "image/png"), "not a readable"),  # a decoder the server never runs
    (data_url(b"hello", "text/plain"), "'text/plain' is not supported"),
    (data_url(PNG, "image/svg+xml"), "'image/svg+xml' is not supported"),
    ("file:///etc/passwd", "'file' is not supported"),
    ("ftp://example.com/a.png", "'ftp' is not supported"),
    ("/etc/passwd", "not a URL"),
])
def test_bad_urls_are_refused_naming_the_image_and_why(url, why):
    assert why in refusal(url)


def test_refusals_never_echo_a_payload():
    raw = base64.b64encode(PNG).decode()  # a payload sent without its data: prefix
    assert len(refusal(raw)) < 200
    assert len(refusal("data:" + "x" * 10_000 + ",AAAA")) < 200  # a media type of 10 kB


def test_a_long_data_url_without_a_comma_is_refused_quickly():
    # one pass over the string: a backtracking pattern over 2 MB would take minutes
    started = time.perf_counter()
    assert "comma" in refusal("data:" + "a" * 2_000_000)
    assert time.perf_counter() - started < 1.0


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/a.png", "HTTPS://example.com/a.png"])
def test_http_urls_are_refused_unless_allowed(url):
    message = refusal(url)
    assert "--allow-image-urls" in message and "data URL" in message


def test_too_many_images_are_refused_before_any_is_read():
    urls = ["file:///etc/passwd"] * 9  # each would be refused on its own: the count is checked first
    with pytest.raises(ImageError, match=r"9 images; this server takes at most 8"):
        load_images(urls, LIMITS)
    assert len(load_images([data_url(PNG)] * 8, LIMITS)) == 8


def test_encoded_size_over_max_bytes_is_refused():
    assert load_image(data_url(PNG), 0, ImageLimits(max_bytes=len(PNG))).image.size == (32, 24)
    message = refusal(data_url(PNG), ImageLimits(max_bytes=len(PNG) - 1))
    assert f"{len(PNG):,} bytes" in message and f"at most {len(PNG) - 1:,}" in message


def test_pixels_over_max_pixels_are_refused():
    assert load_image(data_url(PNG), 0, ImageLimits(max_pixels=32 * 24)).image.size == (32, 24)
    assert "32x24 (768 pixels)" in refusal(data_url(PNG), ImageLimits(max_pixels=32 * 24 - 1))


def test_a_large_compressible_picture_is_refused_by_its_header():
    # 25M pixels of one colour: a few kB encoded, 75 MB decoded; the default limit is 4096 * 4096
    bomb = encode(Image.new("L", (5000, 5000)), optimize=True)
    assert len(bomb) < 100_000
    assert "5000x5000 (25,000,000 pixels)" in refusal(data_url(bomb))


def test_the_size_is_checked_before_the_pixels_are_decoded():
    # garbage pixel data: decoding it first would fail as unreadable, not as too large
    assert "not a readable" in refusal(data_url(png_header_only(64, 64)))
    assert "5000x5000" in refusal(data_url(png_header_only(5000, 5000)))
    assert "too large" in refusal(data_url(png_header_only(20_000, 20_000)))  # past Pillow's own limit too


# --- fetching, when allowed ---------------------------------------------------------------------------------

BIG = b"\0" * 200_000


class ImageHandler(BaseHTTPRequestHandler):
    """``/pattern.png`` is the PNG, ``/big`` 200 kB, anything else 404."""

    def do_GET(self) -> None:
        body = {"/pattern.png": PNG, "/big": BIG}.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), ImageHandler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


FETCHING = ImageLimits(allow_urls=True, fetch_timeout=5.0)


def test_fetched_png_loads(base_url):
    loaded = load_image(f"{base_url}/pattern.png", 0, FETCHING)
    assert loaded.image.size == (32, 24)
    assert loaded.digest == load_image(data_url(PNG), 0, LIMITS).digest


def test_fetch_of_a_missing_url_is_refused_naming_it(base_url):
    message = refusal(f"{base_url}/missing.png", FETCHING)
    assert f"could not fetch {base_url}/missing.png" in message and "404" in message


def test_fetch_from_a_closed_port_is_refused(base_url):
    closed = ThreadingHTTPServer(("127.0.0.1", 0), ImageHandler)
    port = closed.server_address[1]
    closed.server_close()  # nothing listens there now
    assert "could not fetch" in refusal(f"http://127.0.0.1:{port}/pattern.png", FETCHING)


def test_fetched_body_over_max_bytes_is_refused(base_url):
    limits = ImageLimits(allow_urls=True, max_bytes=100_000, fetch_timeout=5.0)
    message = refusal(f"{base_url}/big", limits)
    assert "100,001 bytes" in message and "at most 100,000" in message  # read stopped one byte past the limit

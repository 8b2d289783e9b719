"""Uploaded audio decoded for Whisper (hf_paged_cache/server/http/audio.py): files made here, with the stdlib's
`wave` and with PyAV's own encoders, decode to the samples they hold; what is not audio, or is too long, is refused
with a message that says why."""

from __future__ import annotations

import io
import struct
import wave
from fractions import Fraction

import av
import numpy as np
import pytest

from hf_paged_cache.server.http.audio import AudioError, decode_audio, windows

RATE = 16_000  # Whisper's


def sine(seconds: float, rate: int, amplitude: float = 0.5, hz: float = 440.0) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return (amplitude * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def wav_bytes(channels: np.ndarray, rate: int) -> bytes:
    """A 16-bit PCM WAV of `channels`, ``[C, n]`` floats in [-1, 1], written with the stdlib."""
    pcm = np.round(channels.T * 32767).astype("<i2")  # [C, n] -> interleaved [n, C]
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as file:
        file.setnchannels(channels.shape[0])
        file.setsampwidth(2)
        file.setframerate(rate)
        file.writeframes(pcm.tobytes())
    return buffer.getvalue()


class WriteOnly:
    """A file FFmpeg can only append to, as a browser's MediaRecorder streams: the muxer cannot go back to
    write the duration."""

    def __init__(self):
        self.data = bytearray()

    def write(self, chunk: bytes) -> int:
        self.data += chunk
        return len(chunk)


def encoded(channels: np.ndarray, rate: int, container: str, codec: str, *, seekable: bool = True) -> bytes:
    """`channels` (``[C, n]`` float32) encoded with PyAV's `codec` in a `container` file."""
    layout = {1: "mono", 2: "stereo"}[channels.shape[0]]
    file = io.BytesIO() if seekable else WriteOnly()
    with av.open(file, "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate, layout=layout)
        context = stream.codec_context
        to_codec = av.AudioResampler(format=context.format, layout=layout, rate=rate,
                                     frame_size=context.frame_size or None)
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(channels), format="fltp", layout=layout)
        frame.sample_rate, frame.pts, frame.time_base = rate, 0, Fraction(1, rate)
        for piece in to_codec.resample(frame) + to_codec.resample(None):
            out.mux(stream.encode(piece))
        out.mux(stream.encode(None))
    return file.getvalue() if seekable else bytes(file.data)


def peak_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples))
    return float(np.fft.rfftfreq(len(samples), 1 / rate)[spectrum.argmax()])


def test_stereo_wav_decodes_to_the_mean_of_its_channels_at_16_khz():
    left, right = sine(1.5, 8_000, amplitude=0.5), sine(1.5, 8_000, amplitude=0.1)  # same phase
    samples = decode_audio(wav_bytes(np.stack([left, right]), 8_000))

    assert samples.dtype == np.float32 and samples.ndim == 1
    assert abs(len(samples) - 24_000) <= 4  # 1.5 s at 16 kHz
    assert samples.min() >= -1.0 and samples.max() <= 1.0
    # the mean of the channels, a 0.3 sine (FFmpeg's plain float down-mix would give (0.5 + 0.1) / sqrt(2) = 0.42)
    expected = sine(1.5, RATE, amplitude=0.3)[: len(samples)]
    middle = slice(1_000, len(samples) - 1_000)  # away from the resampler's edges
    np.testing.assert_allclose(samples[middle], expected[middle], atol=0.01)
    assert abs(peak_hz(samples, RATE) - 440) < 2


def test_full_scale_stereo_stays_within_full_scale():
    loud = sine(0.5, RATE, amplitude=1.0)
    samples = decode_audio(wav_bytes(np.stack([loud, loud]), RATE))

    assert 0.99 < np.abs(samples).max() <= 1.0  # not 1.41


def test_flac_and_opus_from_pyav_decode():
    tone = sine(2.0, 44_100, hz=1_000)
    flac = decode_audio(encoded(np.stack([tone, tone]), 44_100, "flac", "flac"))
    assert abs(len(flac) - 32_000) <= 4  # lossless: 2 s exactly
    np.testing.assert_allclose(np.abs(flac[1_000:-1_000]).max(), 0.5, atol=0.01)
    assert abs(peak_hz(flac, RATE) - 1_000) < 2

    opus = decode_audio(encoded(sine(2.0, 48_000)[None], 48_000, "ogg", "libopus"))
    assert abs(len(opus) - 32_000) < 400  # Opus codes 20 ms frames; its pre-skip is trimmed
    assert abs(peak_hz(opus, RATE) - 440) < 2


def test_a_stream_changing_rate_midway_decodes_whole():
    # two raw AAC streams glued together, 1 s at 16 kHz then 1 s at 44.1 kHz: one stream, two rates
    glued = (encoded(sine(1.0, 16_000)[None], 16_000, "adts", "aac")
             + encoded(sine(1.0, 44_100)[None], 44_100, "adts", "aac"))
    samples = decode_audio(glued)

    assert 2.0 * RATE <= len(samples) < 2.3 * RATE  # raw AAC keeps each stream's priming and padding frames
    for start, end in [(0.3, 0.9), (1.4, 2.0)]:  # seconds, inside either stream
        piece = samples[round(start * RATE):round(end * RATE)]
        assert abs(peak_hz(piece, RATE) - 440) < 3 and 0.45 < np.abs(piece).max() < 0.55


@pytest.mark.parametrize(("data", "words"), [
    (b"", "empty"),
    (np.random.default_rng(0).bytes(4_096), "not audio FFmpeg can decode: Invalid data"),
    (b"Dear server, please transcribe this letter.\n" * 50, "not audio FFmpeg can decode"),
    (wav_bytes(sine(1.0, RATE)[None], RATE)[:20], "not audio FFmpeg can decode"),  # a WAV cut inside its header
    (wav_bytes(np.zeros((1, 0), np.float32), RATE), "the audio is empty"),  # a whole header, no samples
], ids=["empty body", "random bytes", "text", "truncated header", "no samples"])
def test_what_is_not_audio_is_refused_with_the_reason(data, words):
    with pytest.raises(AudioError, match=words):
        decode_audio(data)


def test_a_video_without_sound_is_refused():
    file = io.BytesIO()
    with av.open(file, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for index in range(3):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), 40 * index, np.uint8), format="rgb24")
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))

    with pytest.raises(AudioError, match="no audio stream"):
        decode_audio(file.getvalue())


def test_max_seconds_refuses_a_longer_file_by_its_declared_duration():
    data = wav_bytes(sine(1.5, 8_000)[None], 8_000)

    with pytest.raises(AudioError, match=r"the audio lasts 1\.5 s; this server takes at most 1 s"):
        decode_audio(data, max_seconds=1)
    assert abs(len(decode_audio(data, max_seconds=1.5)) - 24_000) <= 4  # the limit itself is allowed


def test_max_seconds_refuses_by_the_declared_duration_before_decoding():
    # a FLAC holding 1 s whose STREAMINFO declares two hours: refused on its word, nothing decoded
    data = bytearray(encoded(sine(1.0, RATE)[None], RATE, "flac", "flac"))
    (info,) = struct.unpack(">Q", data[18:26])  # "fLaC", a block header, 10 bytes of STREAMINFO; then 64 bits
    total_samples = (1 << 36) - 1  # ... whose last 36 are the stream's length in samples
    data[18:26] = struct.pack(">Q", info & ~total_samples | 7_260 * RATE)

    with pytest.raises(AudioError, match=r"the audio lasts 7,260\.0 s; this server takes at most 3,600 s"):
        decode_audio(bytes(data), max_seconds=3_600)
    assert len(decode_audio(bytes(data))) == RATE  # without a limit, the second it holds


def test_max_seconds_refuses_a_file_without_a_duration_while_decoding():
    data = encoded(sine(3.0, 48_000)[None], 48_000, "webm", "libopus", seekable=False)
    with av.open(io.BytesIO(data)) as container:  # what the check must not rely on
        assert container.duration is None and container.streams.audio[0].duration is None

    with pytest.raises(AudioError, match=r"the audio lasts over 1 s; this server takes at most 1 s"):
        decode_audio(data, max_seconds=1)
    assert abs(len(decode_audio(data, max_seconds=4)) - 3 * RATE) < 400


def test_windows_cut_30_second_pieces_and_keep_short_audio_whole():
    long = np.arange(65 * RATE, dtype=np.float32)  # 65 s
    pieces = windows(long, RATE)
    assert [len(piece) / RATE for piece in pieces] == [30.0, 30.0, 5.0]
    np.testing.assert_array_equal(np.concatenate(pieces), long)

    short = long[: 10 * RATE]
    (whole,) = windows(short, RATE)
    np.testing.assert_array_equal(whole, short)
    assert windows(long[:0], RATE) == []

"""Uploaded audio as Whisper's input: the file of a transcription request (wav, flac, mp3, ogg/opus, m4a, webm:
anything FFmpeg reads) decoded from memory to mono float32 samples at the model's rate, cut into 30 s windows.

PyAV (FFmpeg's libraries, bundled in its wheel) demuxes, decodes, down-mixes and resamples. Whatever it refuses,
and audio that is missing, empty or too long, becomes an `AudioError` whose message is for the client.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import av
import numpy as np

# FFmpeg's down-mix matrix scaled so that its gains add up to at most 1: stereo becomes the mean of its channels,
# and no mix passes full scale. Unscaled, float output adds stereo at 1/sqrt(2) each (up to 1.41).
_DOWNMIX = {"rematrix_maxval": "1.0"}


class AudioError(ValueError):
    """An upload that is not audio this server can transcribe; the message says why, for the client."""


def decode_audio(data: bytes, sampling_rate: int = 16_000, *, max_seconds: float | None = None) -> np.ndarray:
    """The first audio stream of the file `data`: mono float32 samples in [-1, 1] at `sampling_rate`, ``[n]``.

    Audio longer than `max_seconds` is refused as soon as that is known: before decoding when the file declares
    its duration, else once the decoded samples pass the limit, so a long upload is never decoded whole.

    Raises `AudioError` for an empty file, one FFmpeg cannot decode, one without an audio stream or without a
    single sample, and one over `max_seconds`.
    """
    if not data:
        raise AudioError("the uploaded file is empty")
    max_samples = None if max_seconds is None else int(max_seconds * sampling_rate)
    chunks: list[np.ndarray] = []
    decoded = 0  # samples at `sampling_rate`
    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.audio:
                raise AudioError("the file has no audio stream")
            stream = container.streams.audio[0]
            declared = _declared_seconds(container, stream)
            if max_seconds is not None and declared is not None and declared > max_seconds:
                raise AudioError(_too_long(declared, max_seconds))
            for chunk in _mono_chunks(container, stream, sampling_rate):
                chunks.append(chunk)
                decoded += len(chunk)
                if max_samples is not None and decoded > max_samples:
                    raise AudioError(_too_long(None, max_seconds))
    except av.error.FFmpegError as error:
        reason = error.strerror or str(error)
        raise AudioError(f"the uploaded file is not audio FFmpeg can decode: {reason}") from error
    if decoded == 0:
        raise AudioError("the audio is empty: its stream holds no samples")
    samples = np.concatenate(chunks)
    return np.clip(samples, -1.0, 1.0, out=samples)  # lossy decoders may overshoot full scale a little


def windows(samples: np.ndarray, sampling_rate: int, seconds: float = 30.0) -> list[np.ndarray]:
    """`samples` cut into consecutive windows of `seconds` (Whisper hears 30 s at a time), the last one shorter.

    Audio no longer than one window is a single window, empty audio none. The windows are views of `samples`.
    """
    size = round(seconds * sampling_rate)  # samples per window
    if size <= 0:
        raise ValueError(f"a window of {seconds} s at {sampling_rate} Hz holds no samples")
    return [samples[start:start + size] for start in range(0, len(samples), size)]


def _mono_chunks(container: av.container.InputContainer, stream: av.AudioStream,
                 sampling_rate: int) -> Iterator[np.ndarray]:
    """`stream` decoded, down-mixed to mono and resampled to `sampling_rate`, chunk by chunk; each ``[n]`` float32.

    A stream may change its rate or layout midway (concatenated files); a resampler takes one input format, so
    each run of frames alike gets its own, flushed at the run's end, as FFmpeg's own tools reconfigure theirs.
    """
    resampler, source = None, None
    for frame in container.decode(stream):
        if (frame.format.name, frame.layout.name, frame.sample_rate) != source:
            if resampler is not None:
                yield from _resampled(resampler, None)
            resampler = av.AudioResampler(format="flt", layout="mono", rate=sampling_rate, options=_DOWNMIX)
            source = (frame.format.name, frame.layout.name, frame.sample_rate)
        yield from _resampled(resampler, frame)
    if resampler is not None:
        yield from _resampled(resampler, None)


def _resampled(resampler: av.AudioResampler, frame: av.AudioFrame | None) -> Iterator[np.ndarray]:
    """What `resampler` gives back for `frame` (None: the samples it still holds, flushed), as ``[n]`` arrays."""
    for out in resampler.resample(frame):
        yield out.to_ndarray().reshape(-1)  # packed mono: [1, n] -> [n]


def _declared_seconds(container: av.container.InputContainer, stream: av.AudioStream) -> float | None:
    """How long the file says `stream` lasts, or None where it does not say (a browser's webm, for one). For a
    raw mp3 or aac stream this is FFmpeg's estimate from the bit rate, which can be a few percent off."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        return container.duration / av.time_base
    return None


def _too_long(seconds: float | None, max_seconds: float) -> str:
    """The message for audio over the limit, with its duration where the file declares it."""
    lasts = f"{seconds:,.1f} s" if seconds is not None else f"over {max_seconds:,g} s"
    return f"the audio lasts {lasts}; this server takes at most {max_seconds:,g} s"

"""Speech to text on a Whisper model: what ``POST /v1/audio/transcriptions`` runs, knowing nothing of HTTP.

An upload is decoded and resampled to the feature extractor's rate (`audio.decode_audio`), cut into windows of
the extractor's length (30 s for Whisper: `audio.windows`), and each window becomes one request of the batcher:
its log-mel features are the encoder's input, and its decoder prompt is Whisper's task prefix, the tokens its
own ``generate`` starts from:

    [<|startofprev|> prompt tokens]  <|startoftranscript|>  <|language|>  <|transcribe|>  <|notimestamps|>

read from the model's generation config (``lang_to_id``, ``task_to_id``, ``no_timestamps_token_id``). The
windows of one upload run side by side in the running batch, beside other uploads' and other requests' rows;
their texts are joined in order. A multilingual model given no language detects it as Whisper does: the most
likely language token after ``<|startoftranscript|>`` on the first window (one decode step, on the batcher too).
"""

from __future__ import annotations

import asyncio
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LogitsProcessor

from .audio import AudioError, decode_audio, windows
from .engine import EngineClient, GenerationOptions
from .generation import ChoiceResult, Generation


@dataclass(frozen=True)
class Segment:
    """One window's transcription (``verbose_json``'s ``segments``)."""

    id: int
    seek: int  # the window's first frame of features (10 ms each)
    start: float  # seconds
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float  # the text's length over its zlib-compressed length (repetition shows as > 2.4)


@dataclass(frozen=True)
class PendingTranscription:
    """A transcription whose windows run: their `generation`, and what its text will say of them."""

    generation: Generation
    windows: list[float]  # each window's seconds of audio
    language: str | None
    temperature: float


@dataclass(frozen=True)
class Transcription:
    text: str
    language: str | None  # the language code, given or detected (None for an English-only model)
    duration: float  # seconds of audio
    segments: list[Segment]


class Transcriber:
    """Transcribes uploads on `engine` (a Whisper model's) with its `feature_extractor`.

    Args:
        engine: the server's engine; its batcher runs every window.
        feature_extractor: the model's (``WhisperFeatureExtractor``): its rate, window length and features.
        generation_config: the model's, naming its task tokens.
        max_seconds: the longest upload transcribed (longer ones: `AudioError`).
    """

    def __init__(self, engine: EngineClient, feature_extractor: Any, generation_config: Any, *, max_seconds: float):
        self.engine = engine
        self.features = feature_extractor
        self.rate = int(feature_extractor.sampling_rate)
        self.window_seconds = float(feature_extractor.chunk_length)
        self.max_seconds = max_seconds
        self.start_of_transcript = _token(generation_config, "decoder_start_token_id")
        self.no_timestamps = _token(generation_config, "no_timestamps_token_id")
        self.previous = getattr(generation_config, "prev_sot_token_id", None)
        self.tasks: dict[str, int] = dict(getattr(generation_config, "task_to_id", None) or {})
        # "<|en|>" -> id, as the generation config names them; keyed here by the code OpenAI's API takes ("en")
        named = getattr(generation_config, "lang_to_id", None) or {}
        self.languages: dict[str, int] = {name.strip("<|>"): id_ for name, id_ in named.items()}

    async def start(self, data: bytes, *, language: str | None, prompt: str | None, temperature: float,
                    task: str = "transcribe") -> PendingTranscription:
        """Decode the audio file `data` and submit its windows (`AudioError`, a `ValueError`, for a file it
        cannot take, and for a language or task the model does not know); `transcription` then reads the
        results of its `generation`."""
        if language is not None and self.languages and language not in self.languages:
            raise ValueError(f"language {language!r} is not one of this model's: {', '.join(sorted(self.languages))}")
        seconds, features = await asyncio.to_thread(self._windows, data)  # decoding takes a while: off the loop
        if language is None and self.languages:
            language = await self._detect_language(features[0])
        decoder = self._decoder_prompt(language, task, prompt)
        generation = self.engine.generate(
            [decoder] * len(features), GenerationOptions(max_tokens=self.engine.max_model_len - len(decoder),
                                                         temperature=temperature, logprobs=0),
            inputs=[{"input_features": window} for window in features],
        )
        return PendingTranscription(generation, seconds, language, temperature)

    def transcription(self, pending: PendingTranscription, results: list[ChoiceResult]) -> Transcription:
        """The text of a transcription whose windows gave `results`, in order."""
        segments = []
        for index, (seconds, result) in enumerate(zip(pending.windows, results)):
            start = index * self.window_seconds
            text = result.text.strip()
            logprobs = [token.logprob for token in result.logprobs]
            encoded = text.encode()
            segments.append(Segment(
                id=index, seek=round(start * 100), start=start, end=start + seconds, text=text,
                tokens=result.tokens, temperature=pending.temperature,
                avg_logprob=sum(logprobs) / len(logprobs) if logprobs else 0.0,
                compression_ratio=len(encoded) / len(zlib.compress(encoded)) if encoded else 0.0,
            ))
        text = " ".join(segment.text for segment in segments if segment.text)
        return Transcription(text, pending.language, sum(pending.windows), segments)

    def _windows(self, data: bytes) -> tuple[list[float], list[torch.Tensor]]:
        """The audio file `data`'s windows: each one's seconds, and its ``[mel bins, frames]`` log-mel features
        (padded to the window's length, as Whisper's)."""
        samples = decode_audio(data, self.rate, max_seconds=self.max_seconds)
        parts = windows(samples, self.rate, self.window_seconds)
        extract = self.features
        features = [extract(part, sampling_rate=self.rate, return_tensors="pt").input_features[0] for part in parts]
        return [len(part) / self.rate for part in parts], features

    def _decoder_prompt(self, language: str | None, task: str, prompt: str | None) -> list[int]:
        """Whisper's task prefix (see the module docstring); `ValueError` for a task the model does not know."""
        tokens = []
        if prompt and self.previous is not None:  # earlier text, to steer spelling and style
            tokens = [self.previous, *self.engine.encode(" " + prompt.strip(), add_special_tokens=False)]
        tokens.append(self.start_of_transcript)
        if language is not None and self.languages:
            tokens.append(self.languages[language])
        if self.tasks:
            if task not in self.tasks:
                raise ValueError(f"task {task!r} is not one of this model's: {', '.join(sorted(self.tasks))}")
            tokens.append(self.tasks[task])
        if self.no_timestamps is not None:
            tokens.append(self.no_timestamps)
        return tokens

    async def _detect_language(self, features: torch.Tensor) -> str:
        """The most likely language token after ``<|startoftranscript|>`` on `features`, as its code."""
        ids = {id_: code for code, id_ in self.languages.items()}
        handle = self.engine.batcher.submit(
            None, input_features=features, decoder_input_ids=[self.start_of_transcript], max_new_tokens=1,
            do_sample=False, logits_processor=[_OnlyTokens(list(ids))],
        )
        (token,) = await asyncio.to_thread(handle.result)
        return ids[token]


class _OnlyTokens(LogitsProcessor):
    """Bans every token but `allowed`."""

    def __init__(self, allowed: list[int]):
        self.allowed = torch.tensor(allowed)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        kept = torch.full_like(scores, -torch.inf)
        kept[:, self.allowed] = scores[:, self.allowed]
        return kept


def _token(config: Any, name: str) -> int | None:
    value = getattr(config, name, None)
    return value[0] if isinstance(value, (list, tuple)) else value


__all__ = ["AudioError", "PendingTranscription", "Segment", "Transcriber", "Transcription"]

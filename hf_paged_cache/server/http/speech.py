"""``POST /v1/audio/transcriptions``: OpenAI's transcription API (a multipart upload) on a Whisper model.

The form's fields are OpenAI's: ``file`` (any audio FFmpeg decodes), ``model``, ``language`` (a code such as
``en``; detected when absent), ``prompt`` (earlier text, to steer spelling), ``response_format`` (``json``,
``text``, ``verbose_json`` with one segment per 30 s window, ``srt``, ``vtt``) and ``temperature`` (0: greedy).
`transcription.Transcriber` does the work; audio it cannot take, and a model that does not transcribe, get a
400 naming the problem. A client that goes away cancels the windows still running.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from .disconnects import results_unless_disconnected
from .errors import APIError, api_error_for
from .lifecycle import ServerLifecycle
from .params import check_model
from .settings import ServerSettings
from .transcription import AudioError, Segment, Transcription

FORMATS = ("json", "text", "verbose_json", "srt", "vtt")


def add_speech_routes(app: FastAPI, lifecycle: ServerLifecycle, settings: ServerSettings,
                      errors: dict[int | str, dict[str, Any]]) -> None:
    """Add the transcription route to `app` (its error answers documented as `errors`)."""

    @app.post("/v1/audio/transcriptions", responses={
        200: {"content": {"application/json": {}, "text/plain": {}}}, **errors,
    })
    async def create_transcription(
        request: Request, file: UploadFile = File(...), model: str = Form(...), language: str | None = Form(None),
        prompt: str | None = Form(None), response_format: str = Form("json"), temperature: float = Form(0.0),
        stream: bool = Form(False),
    ) -> Response:
        engine = lifecycle.engine()
        check_model(model, settings.model_name)
        transcriber = engine.transcriber
        if transcriber is None:
            raise APIError(400, f"{settings.model_name} does not transcribe audio: it is no speech-to-text "
                                "model", param="model", code="model_not_supported")
        if response_format not in FORMATS:
            raise APIError(400, f"response_format must be one of {', '.join(FORMATS)}", param="response_format",
                           code="invalid_value")
        if not 0.0 <= temperature <= 2.0:
            raise APIError(400, "temperature must be between 0 and 2", param="temperature", code="invalid_value")
        if stream:
            raise APIError(400, "streamed transcriptions are not supported", param="stream", code="invalid_value")
        data = await file.read()
        try:
            pending = await transcriber.start(data, language=language or None, prompt=prompt,
                                              temperature=temperature)
        except ValueError as error:  # the audio (AudioError), else the language
            param = "file" if isinstance(error, AudioError) else "language"
            raise APIError(400, str(error), param=param, code="invalid_value") from error
        except Exception as error:  # a full queue (429), shutting down (503), a bug (500)
            raise api_error_for(error) from error
        results = await results_unless_disconnected(request, pending.generation)
        if results is None:
            return Response(status_code=499)  # the client went away: its windows were cancelled
        return _formatted(transcriber.transcription(pending, results), response_format)


def _formatted(result: Transcription, response_format: str) -> Response:
    if response_format == "text":
        return PlainTextResponse(result.text)
    if response_format == "srt":
        cues = [f"{n + 1}\n{_time(s.start, ',')} --> {_time(s.end, ',')}\n{s.text}\n"
                for n, s in enumerate(result.segments)]
        return PlainTextResponse("\n".join(cues))
    if response_format == "vtt":
        cues = [f"{_time(s.start, '.')} --> {_time(s.end, '.')}\n{s.text}\n" for s in result.segments]
        return PlainTextResponse("WEBVTT\n\n" + "\n".join(cues))
    if response_format == "json":
        return JSONResponse({"text": result.text})
    return JSONResponse({
        "task": "transcribe", "language": result.language, "duration": result.duration, "text": result.text,
        "segments": [_segment(segment) for segment in result.segments],
    })


def _segment(segment: Segment) -> dict[str, Any]:
    return {name: getattr(segment, name) for name in Segment.__dataclass_fields__}


def _time(seconds: float, decimal: str) -> str:
    """``HH:MM:SS,mmm`` (SRT; ``.`` before the milliseconds for WebVTT)."""
    milliseconds = round(seconds * 1000)
    hours, rest = divmod(milliseconds, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    return f"{hours:02d}:{minutes:02d}:{rest // 1000:02d}{decimal}{rest % 1000:03d}"

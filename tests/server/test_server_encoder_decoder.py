"""The server on encoder-decoder models, as users meet it: a tiny random BART answering ``/v1/completions`` (the
prompt is the encoder's input) and a tiny random Whisper answering ``/v1/audio/transcriptions`` (the official
client's ``audio.transcriptions.create`` with a WAV file made here, every response format, language detection),
each answer checked against ``generate`` on the same inputs; bad audio and requests the model cannot take get a
400 naming the problem."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
import wave

import httpx
import numpy as np
import pytest
import torch
from encoder_decoder_models import tiny_seq2seq
from json_tokenizer import save_json_tokenizer
from server_process import KEY, NAME, free_port, metric, metrics_text, run_servers
from transformers import (
    AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq, AutoTokenizer, GenerationMixin, WhisperFeatureExtractor,
)

from hf_paged_cache.kernels import pack_linears
from hf_paged_cache.server.http.audio import decode_audio, windows

openai = pytest.importorskip("openai")

RATE = 16_000
LANGUAGES = {"<|en|>": 90, "<|fr|>": 91}  # the tiny Whisper's task tokens (its vocabulary is 96 tokens)
TASKS = {"transcribe": 89, "translate": 88}
NO_TIMESTAMPS, PREVIOUS, START = 87, 86, 93


def save_bart(path):
    save_json_tokenizer(path)
    model = tiny_seq2seq("bart")  # max_position_embeddings 128
    model.save_pretrained(path)
    return path


def save_whisper(path):
    """The tiny Whisper (16 mel bins, 32 frames: windows of 1 s at 16 kHz, hops of 500 samples) with its feature
    extractor, the JSON-capable character tokenizer and Whisper's task tokens in its generation config."""
    save_json_tokenizer(path)
    WhisperFeatureExtractor(feature_size=16, sampling_rate=RATE, hop_length=500, chunk_length=1,
                            n_fft=400).save_pretrained(path)
    model = tiny_seq2seq("whisper")
    config = model.generation_config
    config.lang_to_id, config.task_to_id = LANGUAGES, TASKS
    config.no_timestamps_token_id, config.prev_sot_token_id = NO_TIMESTAMPS, PREVIOUS
    config._from_model_config = False  # a config of its own, as a checkpoint's: loaded with these fields
    model.save_pretrained(path)
    return path


def wav(seconds: float, frequency: float = 220.0) -> bytes:
    """A mono 16-bit WAV at 16 kHz: a tone sweeping up from `frequency`."""
    t = np.arange(int(seconds * RATE))
    samples = (12000 * np.sin(2 * np.pi * frequency * t / RATE * (1 + t / RATE))).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as file:
        file.setnchannels(1)
        file.setsampwidth(2)
        file.setframerate(RATE)
        file.writeframes(samples.tobytes())
    return out.getvalue()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoder-decoder")
    bart, whisper = save_bart(root / "bart"), save_whisper(root / "whisper")
    with run_servers([(bart, root / "bart.log"), (whisper, root / "whisper.log")]) as (bart_server, whisper_server):
        yield {"bart": (bart_server, bart), "whisper": (whisper_server, whisper)}


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


# ---------------------------------------------------------------------------------------------------- BART


@pytest.fixture(scope="module")
def bart(servers):
    server, path = servers["bart"]
    model = AutoModelForSeq2SeqLM.from_pretrained(path, dtype=torch.float32).eval()
    pack_linears(model)  # as the server does (--packed-linears)
    return server, model, AutoTokenizer.from_pretrained(path)


def bart_reference(model, tokenizer, prompt: str, max_tokens: int) -> str:
    ids = torch.tensor([tokenizer(prompt).input_ids])
    out = model.generate(input_ids=ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=[2])
    return tokenizer.decode(out[0, 1:], skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_completions_read_the_prompt_as_the_encoders_input(bart):
    server, model, tokenizer = bart
    prompts = ["hello there", "a longer prompt, of many more characters", "xy"]
    answer = client(server).completions.create(model=NAME, prompt=prompts, max_tokens=12, temperature=0)
    assert [choice.text for choice in sorted(answer.choices, key=lambda c: c.index)] == [
        bart_reference(model, tokenizer, prompt, 12) for prompt in prompts
    ]
    assert answer.usage.prompt_tokens == sum(len(tokenizer(prompt).input_ids) for prompt in prompts)
    streamed = client(server).completions.create(model=NAME, prompt=prompts[0], max_tokens=12, temperature=0,
                                                 stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == answer.choices[0].text


def test_echo_and_audio_are_refused_on_a_text_model(bart):
    server, _, _ = bart
    with pytest.raises(openai.BadRequestError, match="encoder-decoder model"):
        client(server).completions.create(model=NAME, prompt="hi", max_tokens=2, echo=True)
    with pytest.raises(openai.BadRequestError, match="does not transcribe audio"):
        client(server).audio.transcriptions.create(model=NAME, file=("a.wav", wav(0.5)))


def test_speculation_is_refused_at_start_up_by_name(servers):
    _, path = servers["bart"]
    done = subprocess.run(
        [sys.executable, "-m", "hf_paged_cache.serve", str(path), "--port", str(free_port()), "--speculative", "ngram"],
        capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode != 0
    assert "speculative decoding is not supported on BartForConditionalGeneration" in done.stderr


# ---------------------------------------------------------------------------------------------------- Whisper


@pytest.fixture(scope="module")
def whisper(servers):
    server, path = servers["whisper"]
    model = AutoModelForSpeechSeq2Seq.from_pretrained(path, dtype=torch.float32).eval()
    pack_linears(model)
    return server, model, AutoTokenizer.from_pretrained(path), WhisperFeatureExtractor.from_pretrained(path)


def whisper_windows(extractor, audio: bytes) -> list[torch.Tensor]:
    """The features of each 1 s window of `audio`, as the server computes them."""
    samples = decode_audio(audio, RATE)
    parts = windows(samples, RATE, 1.0)
    return [extractor(part, sampling_rate=RATE, return_tensors="pt").input_features for part in parts]


def whisper_reference(model, tokenizer, features: torch.Tensor, decoder: list[int]) -> list[int]:
    """The new tokens ``generate`` (transformers' own loop, without Whisper's long-form wrapper) gives one window."""
    out = GenerationMixin.generate(model, input_features=features, decoder_input_ids=torch.tensor([decoder]),
                                   max_new_tokens=64 - len(decoder), do_sample=False, eos_token_id=[94, 2])
    return out[0, len(decoder):].tolist()  # up to its EOS (94, or the tokenizer's 2), as the server stops


def text_of(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False).strip()


def test_a_transcription_is_each_windows_generate_joined(whisper):
    server, model, tokenizer, extractor = whisper
    audio = wav(2.5)
    decoder = [START, LANGUAGES["<|en|>"], TASKS["transcribe"], NO_TIMESTAMPS]
    expected = [whisper_reference(model, tokenizer, window, decoder) for window in whisper_windows(extractor, audio)]
    texts = [text_of(tokenizer, tokens) for tokens in expected]
    answer = client(server).audio.transcriptions.create(model=NAME, file=("speech.wav", audio), language="en")
    assert answer.text == " ".join(text for text in texts if text)
    verbose = client(server).audio.transcriptions.create(model=NAME, file=("speech.wav", audio), language="en",
                                                         response_format="verbose_json")
    assert [(s.start, s.end) for s in verbose.segments] == [(0.0, 1.0), (1.0, 2.0), (2.0, 2.5)]
    assert [s.tokens for s in verbose.segments] == expected and [s.text for s in verbose.segments] == texts
    assert verbose.duration == 2.5 and verbose.language == "en" and verbose.text == answer.text


def test_text_srt_and_vtt_formats(whisper):
    server, *_ = whisper
    form = {"model": NAME, "language": "en"}
    files = {"file": ("speech.wav", wav(1.5), "audio/wav")}
    headers = {"Authorization": f"Bearer {KEY}"}
    text = httpx.post(f"{server.url}/v1/audio/transcriptions", data={**form, "response_format": "text"},
                      files=files, headers=headers, timeout=60)
    plain = httpx.post(f"{server.url}/v1/audio/transcriptions", data=form, files=files, headers=headers, timeout=60)
    assert text.status_code == 200 and text.text == plain.json()["text"]
    srt = httpx.post(f"{server.url}/v1/audio/transcriptions", data={**form, "response_format": "srt"},
                     files=files, headers=headers, timeout=60).text
    assert srt.startswith("1\n00:00:00,000 --> 00:00:01,000\n") and "2\n00:00:01,000 --> 00:00:01,500\n" in srt
    vtt = httpx.post(f"{server.url}/v1/audio/transcriptions", data={**form, "response_format": "vtt"},
                     files=files, headers=headers, timeout=60).text
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.000\n")


def test_the_language_is_detected_when_not_given(whisper):
    server, model, tokenizer, extractor = whisper
    audio = wav(0.8, frequency=440.0)
    (features,) = whisper_windows(extractor, audio)
    with torch.no_grad():
        logits = model(input_features=features, decoder_input_ids=torch.tensor([[START]])).logits[0, -1]
    detected = max(LANGUAGES, key=lambda name: float(logits[LANGUAGES[name]])).strip("<|>")
    verbose = client(server).audio.transcriptions.create(model=NAME, file=("a.wav", audio),
                                                         response_format="verbose_json")
    decoder = [START, LANGUAGES[f"<|{detected}|>"], TASKS["transcribe"], NO_TIMESTAMPS]
    assert verbose.language == detected
    assert verbose.text == text_of(tokenizer, whisper_reference(model, tokenizer, features, decoder))


def test_a_prompt_steers_the_decoder(whisper):
    server, model, tokenizer, extractor = whisper
    audio = wav(0.6)
    (features,) = whisper_windows(extractor, audio)
    decoder = [PREVIOUS, *tokenizer(" earlier words", add_special_tokens=False).input_ids,
               START, LANGUAGES["<|fr|>"], TASKS["transcribe"], NO_TIMESTAMPS]
    answer = client(server).audio.transcriptions.create(model=NAME, file=("a.wav", audio), language="fr",
                                                        prompt="earlier words")
    assert answer.text == text_of(tokenizer, whisper_reference(model, tokenizer, features, decoder))


@pytest.mark.parametrize(("files", "form", "param", "words"), [
    ({"file": ("a.wav", b"not audio at all", "audio/wav")}, {}, "file", "not audio FFmpeg can decode"),
    ({"file": ("a.wav", b"", "audio/wav")}, {}, "file", "empty"),
    ({"file": ("a.wav", wav(0.5)[:30], "audio/wav")}, {}, "file", "FFmpeg"),
    ({"file": ("a.wav", wav(0.5), "audio/wav")}, {"language": "xx"}, "language", "not one of this model's"),
    ({"file": ("a.wav", wav(0.5), "audio/wav")}, {"response_format": "mp3"}, "response_format", "must be one of"),
    ({"file": ("a.wav", wav(0.5), "audio/wav")}, {"temperature": "3"}, "temperature", "between 0 and 2"),
    ({}, {}, "file", "file"),
])
def test_bad_uploads_get_a_400_naming_the_problem(whisper, files, form, param, words):
    server, *_ = whisper
    response = httpx.post(f"{server.url}/v1/audio/transcriptions", data={"model": NAME, **form}, files=files or None,
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["param"] == param


def test_a_client_that_goes_away_cancels_its_windows(whisper):
    server, *_ = whisper
    cancelled = metric(metrics_text(server), "hf_paged_cache_requests_total", 'finish_reason="cancelled"')
    with pytest.raises(httpx.TimeoutException):  # 120 windows of 1 s: the client gives up first
        httpx.post(f"{server.url}/v1/audio/transcriptions", data={"model": NAME, "language": "en"},
                   files={"file": ("long.wav", wav(120), "audio/wav")}, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=1.0)
    deadline = time.monotonic() + 60
    while True:
        text = metrics_text(server)
        gone = metric(text, "hf_paged_cache_requests_total", 'finish_reason="cancelled"') > cancelled
        if (gone and metric(text, "hf_paged_cache_requests_running") == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert gone and metric(text, "hf_paged_cache_requests_running") == 0


def test_text_completions_are_refused_on_a_speech_model(whisper):
    server, *_ = whisper
    with pytest.raises(openai.BadRequestError, match="reads input_features"):
        client(server).completions.create(model=NAME, prompt="hello", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client(server).audio.transcriptions.create(model="another", file=("a.wav", wav(0.5)))

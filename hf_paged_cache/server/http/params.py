"""From a validated request body to what the engine runs: its prompts' token ids and `GenerationOptions`.

`protocol.py` has already checked types and fixed ranges; what is checked here depends on the server (the
model's name and context, ``--max-n``) or on several fields at once, and parameters that would change the
output and that the server cannot honour are refused by name, never ignored. Every refusal is an `APIError`
400 (404 for an unknown model) naming the parameter.
"""

from __future__ import annotations

import json
from typing import Any

from ...structured import GrammarSpec
from .engine import EngineClient, GenerationOptions
from .errors import APIError
from .protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingRequest


def check_model(requested: str | None, served: str) -> None:
    """404 unless `requested` is the served model's name (or not given)."""
    if requested is not None and requested != served:
        raise APIError(404, f"the model {requested!r} does not exist; this server serves {served!r}",
                       param="model", code="model_not_found")


ENGINE_ARGUMENTS = {
    "max_new_tokens": "max_tokens", "eos_token_id": "stop_token_ids", "temperature": "temperature", "top_p": "top_p",
    "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty", "seed": "seed", "n": "n",
    "logprobs": "logprobs", "prompt_logprobs": "logprobs",
}
"""The batcher's argument names (which its `ValueError` messages start with) and the request fields they come from."""


def param_of_engine_error(message: str, prompt_param: str) -> str | None:
    """The request field a `ValueError` from `submit` is about, from the argument its message names first."""
    name = message.split(":", 1)[0].split(" ", 1)[0]
    return prompt_param if name == "input_ids" else ENGINE_ARGUMENTS.get(name)


def refuse_unsupported(request: SamplingRequest) -> None:
    """400 for a parameter that would change the output and that the server does not implement."""
    unsupported = {
        "logit_bias": bool(request.logit_bias),
        "tools": bool(request.tools) and not isinstance(request, ChatCompletionRequest),
        "tool_choice": request.tool_choice not in (None, "none") and not isinstance(request, ChatCompletionRequest),
        "functions": bool(request.functions),
        "function_call": request.function_call not in (None, "none"),
        "stream_options": request.stream_options is not None and not request.stream,
    }
    if isinstance(request, ChatCompletionRequest):
        unsupported["modalities"] = request.modalities not in (None, ["text"])
        unsupported["audio"] = request.audio is not None
    if isinstance(request, CompletionRequest):
        unsupported["suffix"] = bool(request.suffix)
        unsupported["best_of"] = request.best_of is not None and request.best_of != request.n
    for name, refused in unsupported.items():
        if refused:
            why = "it needs stream=true" if name == "stream_options" else "this server does not support it"
            raise APIError(400, f"{name} is not supported here: {why}", param=name, code="unsupported_parameter")


MAX_SCHEMA_DEPTH = 64  # objects and arrays in a JSON schema, nested (the engine recurses over them)


def _depth(text: str) -> int:
    """How deeply JSON `text` nests objects and arrays (brackets in strings counted too: an upper bound)."""
    depth = deepest = 0
    for character in text:
        if character in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif character in "]}":
            depth -= 1
    return deepest


def grammar_spec(request: SamplingRequest, max_schema_bytes: int) -> tuple[GrammarSpec | None, str | None]:
    """The constraint the request puts on its answer and the field it came from (None, None: none).

    400 when it sets more than one, when a ``response_format`` type is unknown or lacks its schema, or when the
    schema (or pattern, or grammar) is over `max_schema_bytes`.
    """
    found: list[tuple[str, GrammarSpec]] = []
    response_format = request.response_format
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            found.append(("response_format", GrammarSpec.json_object()))
        elif response_format.type == "json_schema":
            if response_format.json_schema is None or response_format.json_schema.schema_ is None:
                raise APIError(400, "response_format of type json_schema needs json_schema.schema",
                               param="response_format", code="invalid_value")
            found.append(("response_format", GrammarSpec.json_schema(response_format.json_schema.schema_)))
        else:
            raise APIError(400, f"response_format type {response_format.type!r} is not one of text, json_object, "
                                "json_schema", param="response_format", code="invalid_value")
    structured = request.structured_outputs
    fields = {
        "guided_json": request.guided_json, "guided_regex": request.guided_regex,
        "guided_choice": request.guided_choice, "guided_grammar": request.guided_grammar,
        "structured_outputs.json": structured and structured.json_,
        "structured_outputs.regex": structured and structured.regex,
        "structured_outputs.choice": structured and structured.choice,
        "structured_outputs.grammar": structured and structured.grammar,
        "structured_outputs.json_object": structured and structured.json_object,
    }
    for name, value in fields.items():
        if value is None or value is False:
            continue
        kind = name.rsplit(".", 1)[-1].removeprefix("guided_")
        if kind == "json":
            found.append((name, GrammarSpec.json_schema(value)))
        elif kind == "json_object":
            found.append((name, GrammarSpec.json_object()))
        elif kind == "regex":
            found.append((name, GrammarSpec.regex(value)))
        elif kind == "choice":
            found.append((name, GrammarSpec.choice(value)))
        else:
            found.append((name, GrammarSpec.lark(value)))
    if not found:
        return None, None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise APIError(400, f"give at most one constraint on the answer, got {names}", param=found[1][0],
                       code="invalid_value")
    param, spec = found[0]
    if spec.kind == "json_schema" and _depth(spec.source) > MAX_SCHEMA_DEPTH:
        raise APIError(400, f"{param} nests deeper than {MAX_SCHEMA_DEPTH} levels", param=param,
                       code="schema_too_deep")
    if len(spec.source.encode("utf-8")) > max_schema_bytes:
        raise APIError(400, f"{param} is {len(spec.source.encode('utf-8'))} bytes, over this server's "
                            f"--max-schema-bytes of {max_schema_bytes}", param=param, code="schema_too_large")
    return spec, param


def completion_prompts(request: CompletionRequest, engine: EngineClient) -> list[list[int]]:
    """The prompts of a completion request as token ids: a string, strings, token ids, or lists of token ids.

    Ids the client sent are checked against the model's vocabulary here, before anything decodes them (``echo``):
    the tokenizer cannot decode an id past 32 bits, or a negative one.
    """
    prompt = request.prompt
    if isinstance(prompt, str):
        prompts = [engine.encode(prompt)] if prompt else [[]]
    elif prompt and all(isinstance(item, str) for item in prompt):
        prompts = [engine.encode(text) if text else [] for text in prompt]
    else:
        ids_only = bool(prompt) and all(isinstance(item, int) for item in prompt)
        prompts = [list(prompt)] if ids_only else [list(ids) for ids in prompt]
        bad = [token for ids in prompts for token in ids if not 0 <= token < engine.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the model's vocabulary of {engine.vocab_size}",
                           param="prompt", code="invalid_value")
    if not prompts or any(not ids for ids in prompts):
        raise APIError(400, "the prompt is empty", param="prompt", code="empty_prompt")
    return prompts


def echo_texts(request: CompletionRequest, prompts: list[list[int]], engine: EngineClient) -> list[str]:
    """What ``echo`` puts before each choice: the prompt as the client sent it (decoded, if sent as ids)."""
    if not request.echo:
        return [""] * len(prompts)
    if isinstance(request.prompt, str):
        return [request.prompt]
    if isinstance(request.prompt[0], str):
        return list(request.prompt)
    return [engine.decode(ids) for ids in prompts]


def chat_messages(messages: list[ChatMessage], image_urls: list[str] | None = None) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: content parts of type "text" are joined. With `image_urls` (a
    model that reads images), a message with ``image_url`` parts keeps its parts, each image as
    ``{"type": "image"}``, and their URLs are appended to `image_urls` in order; without, they are refused."""
    plain = []
    for number, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            allowed = {"text", "image_url"} if image_urls is not None else {"text"}
            kinds = {part.type for part in content} - allowed
            if kinds:
                only = "text and image_url" if image_urls is not None else "text only"
                raise APIError(400, f"messages[{number}]: content of type {sorted(kinds)[0]!r} is not supported "
                                    f"({only})", param="messages", code="unsupported_content")
            content = _with_images(number, content, image_urls) if image_urls is not None else "".join(
                part.text or "" for part in content)
        entry = {"role": message.role, "content": content or ""}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls is not None:
            entry["tool_calls"] = [_parsed_arguments(call) for call in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        plain.append(entry)
    return plain


def _with_images(number: int, parts: list[Any], image_urls: list[str]) -> str | list[dict[str, str]]:
    """A message's parts as the template takes them: its text alone when it has no image, else every part, each
    image as ``{"type": "image"}`` (its URL appended to `image_urls`)."""
    if all(part.type == "text" for part in parts):
        return "".join(part.text or "" for part in parts)
    out: list[dict[str, str]] = []
    for part in parts:
        if part.type == "text":
            out.append({"type": "text", "text": part.text or ""})
            continue
        if part.image_url is None:
            raise APIError(400, f"messages[{number}]: an image_url part needs its image_url.url", param="messages",
                           code="invalid_value")
        image_urls.append(part.image_url.url)
        out.append({"type": "image"})
    return out


def _parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    """An earlier tool call as chat templates take it: its arguments as an object (OpenAI sends JSON text)."""
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            function = {**function, "arguments": json.loads(function["arguments"])}
        except json.JSONDecodeError:
            pass
        return {**call, "function": function}
    return call


def chat_prompt(messages: list[ChatMessage], engine: EngineClient, *, add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The chat's token ids: its messages (and `tools`, if any) through the chat template (with the assistant's
    turn opened)."""
    ids, _ = chat_inputs(messages, engine, add_generation_prompt=add_generation_prompt, tools=tools, images=False)
    return ids


def chat_inputs(messages: list[ChatMessage], engine: EngineClient, *, add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None, images: bool = True) -> tuple[list[int], dict[str, Any]]:
    """`chat_prompt`, with the `submit` arguments of the messages' images (`vision.ImagePrompts`; none without
    images). `images` False, or a model that reads none, refuses image parts."""
    urls: list[str] | None = [] if images and engine.images is not None else None
    try:
        text = engine.render_chat(chat_messages(messages, urls), add_generation_prompt=add_generation_prompt,
                                  tools=tools)
    except ValueError as error:
        raise APIError(400, str(error), param="messages", code="chat_template") from error
    if urls:
        try:
            return engine.images.inputs(text, urls)
        except ValueError as error:  # an image refused (ImageError), or the processor's own complaint
            raise APIError(400, str(error), param="messages", code="invalid_image") from error
    ids = engine.encode(text, add_special_tokens=False)  # the template writes the special tokens it wants
    if not ids:
        raise APIError(400, "the chat template gave an empty prompt", param="messages", code="empty_prompt")
    return ids, {}


def generation_options(
    request: SamplingRequest, prompts: list[list[int]], *, max_model_len: int, max_n: int,
    max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None, prompt_param: str,
) -> GenerationOptions:
    """The request's sampling settings, with `max_tokens` checked against the context (or filling it).

    Args:
        max_tokens: what the request asks for (None: as many as the longest prompt leaves in the context).
        prompt_param: the field that holds the prompt ("prompt" or "messages"), for errors about its length.
    """
    if request.n > max_n:
        raise APIError(400, f"n must be at most {max_n} on this server, got {request.n}", param="n",
                       code="invalid_value")
    longest = max(len(ids) for ids in prompts)
    if longest >= max_model_len:
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens, and the prompt has "
                            f"{longest}: nothing is left to generate", param=prompt_param,
                       code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = max_model_len - longest
    elif longest + max_tokens > max_model_len:
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens, but the prompt's "
                            f"{longest} tokens and max_tokens={max_tokens} make {longest + max_tokens}; ask for at "
                            f"most {max_model_len - longest} new tokens", param="max_tokens",
                       code="context_length_exceeded")
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    if any(not text for text in stop):
        raise APIError(400, "stop strings must not be empty", param="stop", code="invalid_value")
    stop_token_ids = tuple(request.stop_token_ids or ())
    if any(token < 0 for token in stop_token_ids):
        raise APIError(400, "stop_token_ids must be token ids (>= 0)", param="stop_token_ids", code="invalid_value")
    return GenerationOptions(
        max_tokens=max_tokens, n=request.n, temperature=1.0 if request.temperature is None else request.temperature,
        top_p=request.top_p, top_k=request.top_k, min_p=request.min_p, repetition_penalty=request.repetition_penalty,
        presence_penalty=request.presence_penalty or 0.0, frequency_penalty=request.frequency_penalty or 0.0,
        stop=stop, stop_token_ids=stop_token_ids, ignore_eos=request.ignore_eos, seed=request.seed,
        logprobs=logprobs, prompt_logprobs=prompt_logprobs,
    )


def chat_logprobs(request: ChatCompletionRequest) -> int | None:
    """How many alternatives to report per token (None: no logprobs): ``top_logprobs`` needs ``logprobs``."""
    if request.top_logprobs is not None and not request.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs", code="invalid_value")
    return (request.top_logprobs or 0) if request.logprobs else None

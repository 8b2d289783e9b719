"""`build_app`: the OpenAI-compatible FastAPI app, one handler per endpoint.

| route | does |
| --- | --- |
| ``GET /health`` | 200 once the model is loaded; 503 while it loads and once shutting down |
| ``GET /v1/models``, ``GET /v1/models/{id}`` | the served model (404 for another name) |
| ``POST /v1/completions`` | text completion of one or more prompts, ``n`` choices each, streamed or not |
| ``POST /v1/chat/completions`` | the messages through the chat template (images: `vision`), then as a completion |
| ``POST /v1/responses`` | OpenAI's Responses API (stateless), run as a chat completion |
| ``POST /v1/audio/transcriptions`` | OpenAI's speech to text (a multipart upload) on a Whisper model (`speech`) |
| ``POST /tokenize``, ``POST /detokenize`` | vLLM's: a prompt (or messages) to token ids, and back |
| ``GET /metrics`` | Prometheus metrics of the app's own registry |
| ``GET /openapi.json`` | the OpenAPI schema of the routes above: request bodies, answers and error objects |

Handlers turn the request body (`protocol`) into prompts and options (`params`), run them on the engine
(`EngineClient`, which knows nothing of HTTP) and format what comes back (`completions`, `chat`). A client
that goes away cancels its requests: a stream's generator is cancelled by the server, a non-streamed answer
is raced against the connection's ``http.disconnect``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel

from ...structured import GrammarError, GrammarSpec
from .auth import ApiKeyMiddleware
from .chat import ChatFormatter
from .completions import CompletionFormatter
from .disconnects import results_unless_disconnected
from .engine import EngineClient, GenerationOptions
from .errors import APIError, api_error_for, error_response, install_error_handlers, log_if_server_error
from .generation import Generation
from .lifecycle import ServerLifecycle
from .limits import BodyLimitMiddleware
from .metrics import BatcherCollector, LabelledStats, ServerMetrics
from .params import (
    chat_inputs,
    chat_logprobs,
    chat_prompt,
    check_model,
    completion_prompts,
    echo_texts,
    generation_options,
    grammar_spec,
    param_of_engine_error,
    refuse_unsupported,
)
from .protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    ResponseEvent,
    ResponseObject,
    ResponsesRequest,
    SamplingRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from .responses import ResponsesFormatter, chat_request_for, responses_param
from .settings import ServerSettings
from .speech import add_speech_routes
from .tools import tool_request

logger = logging.getLogger("hf_paged_cache.serve")

ERROR_STATUSES = {
    400: "a bad value or type (malformed JSON included), or a request the server cannot run; `param` names the field",
    401: "a missing or wrong API key",
    404: "another model than the one served",
    413: "a body over --max-body-bytes",
    429: "--max-waiting requests already wait",
    500: "a bug (logged with its traceback)",
    503: "the model is loading, or the server is shutting down",
}
"""What each error status means; every error is an OpenAI error object (`ErrorResponse`)."""


def build_app(
    settings: ServerSettings, load_engine: Callable[[ServerMetrics], EngineClient], *,
    on_load_failure: Callable[[BaseException], None] | None = None,
    pool_stats: Callable[[], Sequence[LabelledStats]] | None = None,
) -> FastAPI:
    """The server's app. `load_engine` builds the engine (loads the model) on a thread once the app starts,
    given the app's metrics to count requests in; the app's `ServerLifecycle` is ``app.state.lifecycle``.
    `/metrics` reports the pool of the engine's batcher, or what `pool_stats` returns (replicas of one)."""
    created = int(time.time())  # what /v1/models reports as the model's creation time
    registry = CollectorRegistry()
    metrics = ServerMetrics(registry)
    lifecycle = ServerLifecycle(lambda: load_engine(metrics), shutdown_grace=settings.shutdown_grace,
                                on_load_failure=on_load_failure)
    registry.register(BatcherCollector(pool_stats or (lambda: _lone_batcher_stats(lifecycle))))
    app = FastAPI(
        title="hf_paged_cache", summary="An OpenAI-compatible server on a ContinuousBatcher",
        lifespan=lifecycle.lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json",
    )
    app.state.lifecycle = lifecycle
    open_paths = {"/health"} | (set() if settings.metrics_need_key else {"/metrics"})
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key, open_paths=frozenset(open_paths))  # outermost
    install_error_handlers(app)
    key = (401,) if settings.api_key is not None else ()  # statuses the API key adds to a closed route

    @app.get("/health", responses={
        200: {"content": {"application/json": {"schema": {
            "type": "object", "properties": {"status": {"const": "ok"}}, "required": ["status"],
        }}}},
        **_errors(503),
    })
    async def health() -> Response:
        phase = lifecycle.phase
        if phase != "ready":
            return error_response(503, f"not ready: {phase}", code=phase.replace(" ", "_"))
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models", responses=_errors(*key, 500, 503))
    async def list_models() -> ModelList:
        return ModelList(data=[_model_card(settings, lifecycle.engine(), created)])

    @app.get("/v1/models/{model_id:path}", responses=_errors(*key, 404, 500, 503))
    async def get_model(model_id: str) -> ModelCard:
        check_model(model_id, settings.model_name)
        return _model_card(settings, lifecycle.engine(), created)

    @app.post("/v1/completions", responses={
        200: _answer_content(CompletionResponse, chunk=CompletionResponse),
        **_errors(400, *key, 404, 413, 429, 500, 503),
    })
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        engine = lifecycle.engine()
        check_model(body.model, settings.model_name)
        refuse_unsupported(body)
        if body.echo and engine.decoder_prompt is not None:
            raise APIError(400, f"{settings.model_name} is an encoder-decoder model: its prompt is the encoder's "
                                "input, which the answer does not continue (echo is not supported)",
                           param="echo", code="invalid_value")
        prompts = completion_prompts(body, engine)
        echo_logprobs = body.logprobs if body.echo else None
        options = generation_options(
            body, prompts, max_model_len=engine.max_model_len, max_n=settings.max_n, max_tokens=body.max_tokens,
            logprobs=body.logprobs, prompt_logprobs=echo_logprobs, prompt_param="prompt",
        )
        options = await _constrained(options, body, engine, settings, metrics)
        formatter = CompletionFormatter(
            engine, model=settings.model_name, prompts=prompts, prompt_texts=echo_texts(body, prompts, engine),
            echo=body.echo, logprobs=body.logprobs, tokens_as_ids=body.return_tokens_as_token_ids,
        )
        return await _answer(request, body, _start(engine, prompts, options, "prompt"), formatter)

    add_speech_routes(app, lifecycle, settings, _errors(400, *key, 404, 413, 429, 500, 503))

    @app.post("/v1/chat/completions", responses={
        200: _answer_content(ChatCompletionResponse, chunk=ChatCompletionChunk),
        **_errors(400, *key, 404, 413, 429, 500, 503),
    })
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        engine = lifecycle.engine()
        check_model(body.model, settings.model_name)
        refuse_unsupported(body)
        logprobs = chat_logprobs(body)
        tools = tool_request(body.tools, body.tool_choice, body.parallel_tool_calls, settings.tool_call_parser)
        prompt, images = await asyncio.to_thread(  # decoding images and the processor take a while
            chat_inputs, body.messages, engine, add_generation_prompt=body.add_generation_prompt,
            tools=body.tools if tools is not None else None,
        )
        options = generation_options(
            body, [prompt], max_model_len=engine.max_model_len, max_n=settings.max_n,
            max_tokens=body.max_completion_tokens or body.max_tokens, logprobs=logprobs, prompt_logprobs=None,
            prompt_param="messages",
        )
        options = await _constrained(options, body, engine, settings, metrics,
                               tool_grammar=tools.grammar if tools is not None else None)
        formatter = ChatFormatter(engine, model=settings.model_name, logprobs=logprobs,
                                  tokens_as_ids=body.return_tokens_as_token_ids, tools=tools)
        return await _answer(request, body, _start(engine, [prompt], options, "messages", [images]), formatter)

    @app.post("/v1/responses", responses={
        200: _answer_content(ResponseObject, chunk=ResponseEvent, done=False),
        **_errors(400, *key, 404, 413, 429, 500, 503),
    })
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        engine = lifecycle.engine()
        check_model(body.model, settings.model_name)
        try:
            chat = chat_request_for(body)
            refuse_unsupported(chat)
            tools = tool_request(chat.tools, chat.tool_choice, chat.parallel_tool_calls, settings.tool_call_parser)
            prompt = chat_prompt(chat.messages, engine, tools=chat.tools if tools is not None else None)
            options = generation_options(
                chat, [prompt], max_model_len=engine.max_model_len, max_n=settings.max_n, max_tokens=chat.max_tokens,
                logprobs=None, prompt_logprobs=None, prompt_param="messages",
            )
            options = await _constrained(options, chat, engine, settings, metrics,
                                   tool_grammar=tools.grammar if tools is not None else None)
            generation = _start(engine, [prompt], options, "messages")
        except APIError as error:
            error.param = responses_param(error.param)
            raise
        formatter = ResponsesFormatter(body, model=settings.model_name, tools=tools)
        if body.stream:
            return _event_stream(formatter.events(generation), generation, named=True)
        results = await results_unless_disconnected(request, generation)
        if results is None:
            return Response(status_code=499)
        return Response(formatter.response(generation, results[0]).model_dump_json(), media_type="application/json")

    @app.post("/tokenize", responses=_errors(400, *key, 404, 413, 500, 503))
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        engine = lifecycle.engine()
        check_model(body.model, settings.model_name)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt", code="invalid_request")
        if body.messages is not None:
            ids = chat_prompt(body.messages, engine, add_generation_prompt=body.add_generation_prompt)
        else:
            ids = engine.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids)

    @app.post("/detokenize", responses=_errors(400, *key, 404, 413, 500, 503))
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        engine = lifecycle.engine()
        check_model(body.model, settings.model_name)
        vocab = len(engine.tokenizer)
        bad = [token for token in body.tokens if not 0 <= token < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the tokenizer's vocabulary of {vocab}", param="tokens",
                           code="invalid_value")
        return DetokenizeResponse(prompt=engine.decode(body.tokens))

    @app.get("/metrics", response_class=Response, responses={
        200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
              "description": "Prometheus text exposition"},
        **_errors(*(key if settings.metrics_need_key else ()), 500),
    })
    async def metrics_endpoint() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _lone_batcher_stats(lifecycle: ServerLifecycle) -> list[LabelledStats]:
    batcher = lifecycle.batcher
    return [] if batcher is None else [({}, batcher.stats())]


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """A route's error answers for its OpenAPI schema: an OpenAI error object for each status, and for any other
    client error ("4XX"), which also keeps FastAPI from documenting a 422 this server never sends (it answers 400)."""
    responses: dict[int | str, dict[str, Any]] = {
        status: {"model": ErrorResponse, "description": ERROR_STATUSES[status]} for status in statuses
    }
    responses["4XX"] = {"model": ErrorResponse, "description": "another client error"}
    return responses


def _answer_content(model: type[BaseModel], chunk: type[BaseModel], done: bool = True) -> dict[str, Any]:
    """The 200 of a completion route: `model` as JSON, or (``stream: true``) server-sent events, each event's
    ``data`` a `chunk` or a failure's error object as JSON, then ``[DONE]`` (unless not `done`: the Responses
    API's stream ends with its last event)."""
    data = {"contentMediaType": "application/json", "contentSchema": {
        "anyOf": [_inline_schema(chunk), _inline_schema(ErrorResponse)],
    }}
    event: dict[str, Any] = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
    if done:
        event |= {"if": {"properties": {"data": {"const": "[DONE]"}}}, "else": {"properties": {"data": data}}}
    else:
        event["properties"] = {"data": {"type": "string", **data}, "event": {"type": "string"}}
    end = ", then `[DONE]`" if done else ""
    return {"model": model, "content": {"text/event-stream": {"schema": event}},
            "description": f"the whole answer; with `stream: true`, one event per `{chunk.__name__}`{end}"}


def _inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """`model`'s JSON schema as it is serialized, its nested models written out in place (an event's schema
    cannot point into the schema's components for models that no route names)."""
    schema = model.model_json_schema(mode="serialization")
    definitions = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(definitions[node["$ref"].rsplit("/", 1)[-1]])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(value) for value in node]
        return node

    return inline(schema)


def _model_card(settings: ServerSettings, engine: EngineClient, created: int) -> ModelCard:
    return ModelCard(id=settings.model_name, created=created, root=settings.model_root,
                     max_model_len=engine.max_model_len)


async def _constrained(
    options: GenerationOptions, body: SamplingRequest, engine: EngineClient, settings: ServerSettings,
    metrics: ServerMetrics, tool_grammar: GrammarSpec | None = None,
) -> GenerationOptions:
    """`options` with the grammar the request holds its answer to (compiled, or from the cache), if any; a 400
    naming the field when the engine cannot compile it, or not within ``--grammar-compile-timeout`` (compiling
    runs on a thread, so other requests' streams go on meanwhile). `tool_grammar`: the tool call that
    ``tool_choice`` requires, which excludes any other constraint."""
    spec, param = grammar_spec(body, settings.max_schema_bytes)
    if tool_grammar is not None:
        if spec is not None:
            raise APIError(400, f"tool_choice {body.tool_choice!r} decides the answer's form: {param} cannot be set "
                                "too", param=param, code="invalid_value")
        spec, param = tool_grammar, "tools"
        if len(spec.source.encode("utf-8")) > settings.max_schema_bytes:
            raise APIError(400, f"the tools' parameter schemas are over this server's --max-schema-bytes of "
                                f"{settings.max_schema_bytes}", param="tools", code="schema_too_large")
    if spec is None:
        return options
    try:
        grammar = await asyncio.wait_for(asyncio.to_thread(engine.compile_grammar, spec),
                                         settings.grammar_compile_timeout)
    except GrammarError as error:
        raise APIError(400, f"{param}: {error}", param=param, code="invalid_grammar") from error
    except TimeoutError as error:
        raise APIError(400, f"{param}: the grammar did not compile within {settings.grammar_compile_timeout} s",
                       param=param, code="grammar_timeout") from error
    metrics.structured_requests.labels(spec.kind).inc()
    return dataclasses.replace(options, grammar=grammar)


def _start(
    engine: EngineClient, prompts: list[list[int]], options: GenerationOptions, prompt_param: str,
    inputs: list[dict[str, Any]] | None = None,
) -> Generation:
    """Submit the request's prompts (with their `inputs` besides tokens: `EngineClient.generate`); what the
    batcher refuses becomes an `APIError` naming the field if it can."""
    try:
        return engine.generate(prompts, options, inputs=inputs)
    except Exception as error:
        api_error = api_error_for(error)
        if isinstance(error, ValueError):
            api_error.param = param_of_engine_error(str(error), prompt_param)
        raise api_error from error


async def _answer(
    request: Request, body: SamplingRequest, generation: Generation, formatter: CompletionFormatter | ChatFormatter,
) -> Response:
    """The answer to a started request: a stream of server-sent events, or the whole response once done."""
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return _event_stream(formatter.chunks(generation, include_usage), generation)
    results = await results_unless_disconnected(request, generation)
    if results is None:
        return Response(status_code=499)  # the client went away: nobody reads this
    return Response(formatter.response(generation, results).model_dump_json(), media_type="application/json")


def _event_stream(chunks: AsyncIterator[BaseModel], generation: Generation, named: bool = False) -> EventSourceResponse:
    """A server-sent event per chunk (``data: {json}``), then ``data: [DONE]``; with `named` (the Responses API),
    each event is named by its chunk's ``type`` and there is no ``[DONE]``.

    A failure mid-stream becomes an OpenAI error object as the last event. If the client goes away, the server
    cancels this generator; its ``finally`` cancels the request's choices.
    """

    async def events() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield format_sse_event(data_str=chunk.model_dump_json(), event=chunk.type if named else None)
        except Exception as failure:  # noqa: BLE001 (reported to the client as the stream's last event)
            error = api_error_for(failure)
            log_if_server_error(error, failure)
            yield format_sse_event(data_str=error.body().model_dump_json(), event="error" if named else None)
        finally:
            generation.cancel()
        if not named:
            yield format_sse_event(data_str="[DONE]")

    return EventSourceResponse(events(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

"""The OpenAI wire format: pydantic models of what the server reads and writes, and nothing else.

Requests are validated strictly (a string is not a number, a number is not a boolean) and their fields carry
the ranges that do not depend on the server's settings, so a wrong type or value becomes a 400 naming the
field (`errors.py`); unknown fields are ignored, as OpenAI's SDKs send some that vary by version. Fields
that would change the output and that the server cannot honour are accepted here and refused by
`params.py`, with the field's name. Responses mirror OpenAI's (and vLLM's, for ``/tokenize``,
``/detokenize`` and the extra sampling fields).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from ...engine.logprobs import MAX_LOGPROBS


class _Request(BaseModel):
    """A request body's part: strict types, no NaN or infinity, unknown fields ignored."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class _Response(BaseModel):
    """A response's part, serialized as OpenAI's (null fields included, unless a model says otherwise)."""


# ------------------------------------------------------------------ requests


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    """``response_format.json_schema``: the schema the answer must validate against."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: str  # "text", "json_object" or "json_schema"
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Request):
    """vLLM's ``structured_outputs``: one of these constraints on the answer."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingRequest(_Request):
    """The fields `/v1/completions` and `/v1/chat/completions` share."""

    model: str | None = None
    n: int = Field(1, ge=1)  # the server's --max-n is checked by params.py
    max_tokens: int | None = Field(None, ge=1)  # None: up to the context
    temperature: float | None = Field(None, ge=0, le=2)  # 0: greedy; None: 1
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # vLLM's: -1 or 0 turn it off
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # an int64, as OpenAI's
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:123"
    response_format: ResponseFormat | None = None
    # vLLM's structured outputs (`params.grammar_spec` takes at most one of these and response_format)
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # accepted so that params.py can refuse them by name when set
    logit_bias: dict[str, float] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None


class ImageURL(_Request):
    url: str
    detail: str | None = None  # OpenAI's "low" / "high" / "auto": the processor decides the resolution here


class TextPart(_Request):
    """A content part: ``text``, or ``image_url`` (for a model that reads images)."""

    type: str
    text: str | None = None
    image_url: ImageURL | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls, as OpenAI sends them
    tool_call_id: str | None = None  # a "tool" message: the call it answers


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    modalities: list[str] | None = None  # refused unless ["text"]
    audio: Any = None  # refused when set
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True  # vLLM's
    parallel_tool_calls: bool | None = None  # false: at most one call


class TokenizeRequest(_Request):
    """vLLM's ``/tokenize``: a `prompt`, or chat `messages` put through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# ------------------------------------------------------------------ responses


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str  # JSON text


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_Response):
    """The answer's message; ``tool_calls`` is left out when it has none, as OpenAI does."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _without_no_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {name: value for name, value in handler(self).items() if name != "tool_calls" or value is not None}


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class DeltaFunctionCall(_Response):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {name: value for name, value in handler(self).items() if value is not None}


class DeltaToolCall(_Response):
    """A part of a streamed call: the first has its id, type and name; the rest add to its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {name: value for name, value in handler(self).items() if value is not None}


class DeltaMessage(_Response):
    """What a chat chunk adds to a choice's message; fields not set are left out, as OpenAI does."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {name: value for name, value in handler(self).items() if value is not None}


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "hf_paged_cache"
    root: str
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Response):
    prompt: str


# ------------------------------------------------------------------ the Responses API (/v1/responses)


class ResponsesTextFormat(_Request):
    type: str  # "text", "json_object" or "json_schema"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponsesText(_Request):
    format: ResponsesTextFormat | None = None


class InputContentPart(_Request):
    type: str  # "input_text" or "output_text"
    text: str | None = None


class InputItem(_Request):
    """An item of ``input``: a message (``type`` "message" or left out), a function call the model made
    (``function_call``) or its output (``function_call_output``)."""

    type: str = "message"
    role: str | None = None
    content: str | list[InputContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None


class ResponsesRequest(_Request):
    """``POST /v1/responses``: stateless (``previous_response_id`` is refused, nothing is stored)."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stream: bool = False
    text: ResponsesText | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    user: str | None = None


class OutputText(_Response):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(_Response):
    type: Literal["message"] = "message"
    id: str
    status: str = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(_Response):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


class ResponsesUsage(_Response):
    input_tokens: int
    output_tokens: int
    total_tokens: int


class IncompleteDetails(_Response):
    reason: str


class ResponseObject(_Response):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: str  # "in_progress", "completed" or "incomplete"
    model: str
    output: list[OutputMessage | OutputFunctionCall] = Field(default_factory=list)
    usage: ResponsesUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ErrorInfo | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool = True
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    previous_response_id: str | None = None
    store: bool = False
    metadata: dict[str, str] = Field(default_factory=dict)


class ResponseEvent(_Response):
    """One event of a streamed response; the fields other than `type` and `sequence_number` are those its type
    carries (left out otherwise)."""

    type: str
    sequence_number: int
    response: ResponseObject | None = None
    output_index: int | None = None
    content_index: int | None = None
    item_id: str | None = None
    item: OutputMessage | OutputFunctionCall | None = None
    part: OutputText | None = None
    delta: str | None = None
    text: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {name: value for name, value in handler(self).items() if value is not None}

"""The OpenAI API's bodies as pydantic models (requests: strict types, unknown fields refused) and the semantic
checks of a request.

The routes of `dflash_jax.server.app` take and return these models, so `/openapi.json` describes every body.
Parsing is two-stage: FastAPI validates the body against the request model (→ 400 naming the field), then
`sampling_of` / `check_*` check ranges and unsupported values with OpenAI-like messages (→ 400 with `param`).
Fields that OpenAI clients commonly send with a neutral value (`presence_penalty: 0`, `user`, ...) are accepted
when neutral and refused with a clear message otherwise.

Log-probabilities (`logprobs`, `top_logprobs`, `echo`) are the target model's raw distribution: log_softmax of its
logits at the position, before temperature, top-k and top-p (vLLM's default `raw_logprobs`); they are the same
with and without speculative decoding.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from dflash_jax.checkpoints.tokenizer import TEMPLATE_VARIABLES
from dflash_jax.server.errors import APIError, bad_request
from dflash_jax.types import MAX_TOP_LOGPROBS, SamplingParams

MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 1024
MAX_STOP_TOKEN_IDS = 64
MAX_N = 128
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _integral(value: Any) -> Any:
    """JSON Schema's integers include `5.0` (a number with no fractional part): taken as 5; `5.5`, `true` and
    `"5"` stay refused by the strict integer check."""
    return int(value) if type(value) is float and value.is_integer() else value


def _int(**limits: Any) -> Any:
    """An integer field's type: strict, `5.0` read as 5, with these `Field` limits (ge/le)."""
    return Annotated[int, Field(**limits), BeforeValidator(_integral)]


TokenId = _int(ge=0)  # the vocabulary's upper bound is the served model's: `/openapi.json` states it
NonEmptyStr = Annotated[str, Field(min_length=1)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN)]


class StreamOptions(_Strict):
    include_usage: bool = Field(False, description="a last chunk with no choices carries the request's usage")
    continuous_usage_stats: bool = Field(
        False,
        description="every chunk carries `usage`: the prompt's tokens and the tokens of the chunk's choice so far "
        "(as vLLM does; a choice-less chunk, such as the last one with `include_usage`, counts every choice)",
    )


TemplateKwargs = Annotated[
    dict[str, Any], Field(json_schema_extra={"propertyNames": {"not": {"enum": list(TEMPLATE_VARIABLES)}}})
]


MAX_TOOLS = 128
MAX_CHOICES = 1024
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]
# A JSON schema (an object), or one given as JSON text (vLLM's `guided_json`).
JsonSchema = dict[str, Any]


class ResponseFormatText(_Strict):
    type: Literal["text"] = Field(description="plain text (the default)")


class ResponseFormatJsonObject(_Strict):
    type: Literal["json_object"] = Field(description="any JSON object")


class JsonSchemaFormat(_Strict):
    name: FunctionName = Field(description="the schema's name")
    description: str | None = None
    schema_: JsonSchema | None = Field(
        None, alias="schema", description="the JSON schema the output follows (absent: any JSON object)"
    )
    strict: bool | None = Field(None, description="the schema is enforced token by token either way")


class ResponseFormatJsonSchema(_Strict):
    type: Literal["json_schema"] = Field(description="JSON that follows `json_schema.schema`")
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema, Field(discriminator="type")
]


class StructuredOutputs(_Strict):
    """vLLM's structured outputs: exactly one of the constraints."""

    model_config = ConfigDict(json_schema_extra={"minProperties": 1, "maxProperties": 1})

    json_: JsonSchema | str = Field(None, alias="json", description="a JSON schema (object or JSON text)")  # type: ignore[assignment]
    regex: str = Field(None, description="a regular expression the whole output matches")  # type: ignore[assignment]
    choice: Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)] = Field(  # type: ignore[assignment]
        None, description="the output is one of these strings"
    )
    grammar: str = Field(None, description="a Lark (or GBNF) grammar")  # type: ignore[assignment]
    json_object: Literal[True] = Field(None, description="any JSON object")  # type: ignore[assignment]


class FunctionDef(_Strict):
    name: FunctionName
    description: str | None = None
    parameters: JsonSchema | None = Field(None, description="a JSON schema of the arguments (an object)")
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionChoice(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionChoice


class FunctionCall(_Strict):
    name: FunctionName
    arguments: str = Field(description="the arguments as JSON text")


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class TextPart(_Strict):
    type: Literal["text"]
    text: str


def _message_rules(schema: dict[str, Any]) -> None:
    schema["allOf"] = [
        _rule(
            _given("role", {"const": "tool"}), {"required": ["tool_call_id"], "properties": {"tool_call_id": _NOT_NULL}}
        ),
        _rule(_given("tool_calls", _NOT_NULL), _given("role", {"const": "assistant"})),
        _rule(_given("tool_call_id", _NOT_NULL), _given("role", {"const": "tool"})),
    ]


class ChatMessage(_Strict):
    model_config = ConfigDict(json_schema_extra=lambda schema: _message_rules(schema))

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant message's tool calls")
    tool_call_id: str | None = Field(None, description="a tool message: the call it answers")

    @model_validator(mode="after")
    def _roles(self) -> ChatMessage:
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs 'tool_call_id' (the call it answers)")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only a tool message has 'tool_call_id'")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has 'tool_calls'")
        return self


_ONE_CONSTRAINT = (
    "At most one of response_format (json_object / json_schema), structured_outputs, guided_json, guided_regex, "
    "guided_choice, guided_grammar and a chat request's tool_choice required / named function constrains the output."
)


class _Common(_Strict):
    model: str = Field(description="the served model's id (GET /v1/models)")
    max_tokens: _int(ge=1) | None = Field(None, description="most tokens to generate (default: up to the context)")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy (default 1)")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="nucleus sampling mass (default 1)")
    top_k: _int(ge=-1) | None = Field(None, description="keep the k most likely tokens; 0 or -1 = off")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description=f"up to {MAX_STOP_STRINGS} non-empty stop strings"
    )
    stream: bool = Field(False, description="answer with server-sent events")
    stream_options: StreamOptions | None = Field(None, description="only with `stream: true`")
    seed: _int(ge=INT64_MIN, le=INT64_MAX) | None = Field(None, description="makes sampling reproducible")
    n: _int(ge=1, le=MAX_N) | None = Field(
        None,
        description="choices per prompt; with `seed`, choice i samples with seed + i, so it equals a one-choice "
        "request with that seed; at temperature 0 the choices are identical (one generation, as many copies)",
    )
    ignore_eos: bool = Field(False, description="keep generating past end-of-sequence tokens")
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(
        None,
        description="token ids that end the choice like end-of-sequence (also with ignore_eos); the stop token is in "
        "`token_ids`, not in the text",
    )
    min_tokens: _int(ge=0) = Field(
        0,
        description="end-of-sequence (unless ignore_eos) and the stop tokens are masked from sampling until this "
        "many tokens are generated, and no stop string ends the choice earlier; at most the completion's length "
        "(max_tokens, or the context the prompt leaves)",
    )
    return_token_ids: bool = Field(
        False, description="the choice also carries `token_ids` (and `prompt_token_ids`), as in vLLM"
    )
    response_format: ResponseFormat | None = Field(
        None,
        description="text (the default), any JSON object, or JSON that follows a schema (enforced by the grammar). "
        + _ONE_CONSTRAINT,
    )
    structured_outputs: StructuredOutputs | None = Field(
        None,
        description="vLLM's structured outputs: one of json, regex, choice, grammar, json_object. " + _ONE_CONSTRAINT,
    )
    guided_json: JsonSchema | str | None = Field(
        None, description="vLLM: the output follows this JSON schema. " + _ONE_CONSTRAINT
    )
    guided_regex: str | None = Field(
        None, description="vLLM: the output matches this regular expression. " + _ONE_CONSTRAINT
    )
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)] | None = Field(
        None, description="vLLM: the output is one of these strings. " + _ONE_CONSTRAINT
    )
    guided_grammar: str | None = Field(
        None, description="vLLM: the output follows this Lark (or GBNF) grammar. " + _ONE_CONSTRAINT
    )
    user: str | None = None
    presence_penalty: float | None = Field(None, ge=0.0, le=0.0, description="only 0")
    frequency_penalty: float | None = Field(None, ge=0.0, le=0.0, description="only 0")
    logit_bias: Annotated[dict[str, float], Field(max_length=0)] | None = Field(
        None, description="not supported (only empty)"
    )


class CompletionRequest(_Common):
    model_config = ConfigDict(json_schema_extra=lambda schema: _completion_rules(schema))

    prompt: (
        NonEmptyStr
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[NonEmptyStr], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    ) = Field(description="a prompt (text or token ids) or a list of prompts; prompt p's choices have index p * n + i")
    max_tokens: _int(ge=0) | None = Field(
        None, description="most tokens to generate (default: up to the context); 0 only with `echo`"
    )
    logprobs: _int(ge=0, le=MAX_TOP_LOGPROBS) | None = Field(
        None,
        description="log-probabilities of the tokens (the model's raw distribution, before temperature/top-k/top-p)"
        " and this many most likely alternatives per token",
    )
    echo: bool = Field(
        False,
        description="the prompt comes back before the completion (with `logprobs`, its tokens' log-probabilities;"
        " the first token's is null); `max_tokens: 0` scores the prompt only",
    )
    best_of: _int(ge=1, le=1) | None = Field(None, description="only 1")
    suffix: None = Field(None, description="not supported (only null)")


class ChatCompletionRequest(_Common):
    model_config = ConfigDict(json_schema_extra=lambda schema: _chat_rules(schema))

    messages: list[ChatMessage] = Field(
        min_length=1, description="the conversation, rendered by the model's chat template"
    )
    max_completion_tokens: _int(ge=1) | None = Field(
        None, description="most tokens to generate: the same as max_tokens (give one of them)"
    )
    chat_template_kwargs: TemplateKwargs | None = Field(
        None,
        description='extra variables for the chat template, e.g. {"enable_thinking": false} for Qwen3 templates',
    )
    logprobs: bool | None = Field(
        None,
        description="log-probability of each generated token (the model's raw distribution, before"
        " temperature/top-k/top-p)",
    )
    top_logprobs: _int(ge=0, le=MAX_TOP_LOGPROBS) | None = Field(
        None, description="with `logprobs: true`: this many most likely tokens per position"
    )
    tools: Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)] | None = Field(
        None, description="functions the model may call, rendered by the chat template's tool format"
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description="with `tools`: auto (the default: the output is parsed for calls), none, required (at least one "
        "call) or a named function (one call of it); required and named calls follow the tools' schemas. "
        + _ONE_CONSTRAINT,
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (default true)")


class TokenizeRequest(_Strict):
    """Exactly one of `prompt` and `messages`."""

    model_config = ConfigDict(json_schema_extra=lambda schema: _tokenize_rules(schema))

    model: str | None = None
    prompt: str = Field(None, description="text to tokenize (not with `messages`)")  # type: ignore[assignment]
    messages: list[ChatMessage] = Field(  # type: ignore[assignment]
        None, min_length=1, description="chat messages, rendered by the chat template (not with `prompt`)"
    )
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: TemplateKwargs | None = Field(None, description="with `messages`: as in chat completions")


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId]


class TokenizerInfo(BaseModel):
    """The served tokenizer, as vLLM's `/tokenizer_info` describes it (lm-eval's `tokenizer_backend=remote` reads
    it): special tokens as text (their ids: POST /tokenize with `add_special_tokens: false`), the chat template
    (null when the model has none) and the context length."""

    model_config = ConfigDict(extra="allow")

    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    add_bos_token: bool = Field(description="a prompt given as text starts with `bos_token`")
    model_max_length: int = Field(description="the served context length (max_model_len)")
    chat_template: str | None


# ------------------------------------------------------------------------ rules across fields (the schema)


def _rule(condition: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    return {"if": condition, "then": then}


def _given(field: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": [field], "properties": {field: schema}}


_NOT_NULL = {"not": {"type": "null"}}
_STREAM_OPTIONS_NEED_STREAM = _rule(_given("stream_options", _NOT_NULL), _given("stream", {"const": True}))


def _completion_rules(schema: dict[str, Any]) -> None:
    schema["allOf"] = [
        _STREAM_OPTIONS_NEED_STREAM,
        _rule(_given("max_tokens", {"const": 0}), _given("echo", {"const": True})),
    ]


def _chat_rules(schema: dict[str, Any]) -> None:
    schema["allOf"] = [
        _rule(_given("tool_choice", _NOT_NULL), _given("tools", _NOT_NULL)),
        _STREAM_OPTIONS_NEED_STREAM,
        _rule(_given("top_logprobs", _NOT_NULL), _given("logprobs", {"const": True})),
        {
            "not": {
                "required": ["max_tokens", "max_completion_tokens"],
                "properties": {"max_tokens": _NOT_NULL, "max_completion_tokens": _NOT_NULL},
            }
        },
    ]


def _tokenize_rules(schema: dict[str, Any]) -> None:
    schema["oneOf"] = [{"required": ["prompt"]}, {"required": ["messages"]}]
    schema["allOf"] = [_rule(_given("prompt", {}), {"not": _given("chat_template_kwargs", _NOT_NULL)})]


# ------------------------------------------------------------------------------------------- responses


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, not_found_error, rate_limit_error, ...")
    param: str | None = Field(description="the request field at fault, e.g. 'messages[0].content'")
    code: str | None = Field(description="machine-readable reason, e.g. 'context_length_exceeded'")


class ErrorResponse(BaseModel):
    """Every error, in OpenAI's shape."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpecDecodeStats(BaseModel):
    """Speculative-decoding counters of one request."""

    num_drafts: int = Field(description="speculative steps")
    num_draft_tokens: int
    num_accepted_tokens: int
    mean_acceptance_length: float | None = Field(description="1 + accepted / drafts (tokens per step)")
    draft_acceptance_rate: float | None
    accepted_per_position: list[int] = Field(description="accepted drafts by position in the block")


class ResponseMetrics(BaseModel):
    speculative_decoding: SpecDecodeStats | None = Field(description="null when the request ran without a drafter")


class TopLogprob(BaseModel):
    token: str = Field(description="the token's text (a partial UTF-8 character shows as U+FFFD)")
    logprob: float
    bytes: list[int] | None = Field(description="the token's raw bytes")


class ChatTokenLogprob(BaseModel):
    token: str = Field(description="the token's text (a partial UTF-8 character shows as U+FFFD)")
    logprob: float
    bytes: list[int] | None = Field(description="the token's raw bytes")
    top_logprobs: list[TopLogprob] = Field(description="the `top_logprobs` most likely tokens, most likely first")


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = Field(description="one entry per generated token")


class CompletionLogprobs(BaseModel):
    """Per token (with `echo`, the prompt's first): its text, log-probability, most likely alternatives (the
    chosen token included) and offset in the choice's text. The prompt's first token has no log-probability."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


_TOKEN_IDS = "with `return_token_ids`: the generated token ids"
_PROMPT_IDS = "with `return_token_ids`: the prompt's token ids"


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = Field(description="stop | length")
    prompt_token_ids: list[int] | None = Field(None, description=_PROMPT_IDS)
    token_ids: list[int] | None = Field(None, description=_TOKEN_IDS)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    metrics: ResponseMetrics


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the message is only tool calls")
    tool_calls: list[ToolCall] | None = Field(None, description="the calls the model made (finish_reason tool_calls)")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = Field(description="stop | length | tool_calls")
    prompt_token_ids: list[int] | None = Field(None, description=_PROMPT_IDS)
    token_ids: list[int] | None = Field(None, description=_TOKEN_IDS)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    metrics: ResponseMetrics


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = Field(None, description="of this chunk's tokens")
    finish_reason: str | None
    token_ids: list[int] | None = Field(None, description=_TOKEN_IDS + " of this chunk")


class CompletionChunk(BaseModel):
    """One `data:` event of a streamed completion. With `stream_options.include_usage`, every chunk has
    `usage: null` and a last chunk with no choices carries the usage; with `continuous_usage_stats`, every chunk
    carries the usage of its choice so far."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None
    metrics: ResponseMetrics | None = Field(None, description="on the chunk that finishes the choice")


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = Field(None, description="the next piece of the arguments' JSON text")


class ToolCallDelta(BaseModel):
    index: int = Field(description="the call's position in the message")
    id: str | None = Field(None, description="on the call's first delta")
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = Field(None, description="of this chunk's tokens")
    finish_reason: str | None
    token_ids: list[int] | None = Field(None, description=_TOKEN_IDS + " of this chunk")


class ChatCompletionChunk(BaseModel):
    """One `data:` event of a streamed chat completion (the first carries the role). With
    `stream_options.include_usage`, every chunk has `usage: null` and a last chunk with no choices carries it;
    with `continuous_usage_stats`, every chunk carries the usage of its choice so far."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    metrics: ResponseMetrics | None = Field(None, description="on the chunk that finishes the choice")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str = Field(description="the model the server loaded (--model)")
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    status: Literal["ok"]


# --------------------------------------------------------------------------------------- semantic checks


def _range_error(param: str, what: str, value: object) -> APIError:
    return bad_request(f"Invalid value for '{param}': {what}, but got {value!r} instead.", param=param)


def max_tokens_of(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """The requested completion length (chat: `max_completion_tokens` is the same field under its newer name)."""
    value, param = req.max_tokens, "max_tokens"
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        if req.max_tokens is not None:
            raise bad_request(
                f"'max_tokens' ({req.max_tokens}) and 'max_completion_tokens' ({req.max_completion_tokens}) are the "
                "same setting: give one of them.",
                "max_completion_tokens",
            )
        value, param = req.max_completion_tokens, "max_completion_tokens"
    if value is not None and value < 1:
        raise _range_error(param, "expected an integer >= 1", value)
    return value


def sampling_of(req: CompletionRequest | ChatCompletionRequest, vocab_size: int | None) -> SamplingParams:
    """The request's sampling (the fields' ranges are checked by their pydantic `Field` limits); top-k 0, -1 or
    at least the vocabulary is off."""
    t = 1.0 if req.temperature is None else req.temperature
    p = 1.0 if req.top_p is None else req.top_p
    k = 0 if req.top_k is None else req.top_k
    cap = vocab_size if vocab_size else 2**31 - 1
    k = 0 if k <= 0 or k >= cap else k
    return SamplingParams(temperature=float(t), top_p=float(p), top_k=int(k), seed=req.seed)


def stop_of(req: CompletionRequest | ChatCompletionRequest) -> tuple[str, ...]:
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"Invalid 'stop': at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}.", "stop")
    for i, s in enumerate(stops):
        if not s:
            raise bad_request(f"Invalid 'stop[{i}]': stop strings must not be empty.", "stop")
        if len(s) > MAX_STOP_LEN:
            raise bad_request(f"Invalid 'stop[{i}]': longer than {MAX_STOP_LEN} characters.", "stop")
    return tuple(dict.fromkeys(stops))


def _unsupported(param: str, why: str = "is not supported by this server") -> APIError:
    return bad_request(f"'{param}' {why}.", param=param, code="unsupported_parameter")


def check_common(req: CompletionRequest | ChatCompletionRequest) -> None:
    if req.n is not None and not 1 <= req.n <= MAX_N:
        raise _range_error("n", f"expected an integer between 1 and {MAX_N}", req.n)
    if req.min_tokens < 0:
        raise _range_error("min_tokens", "expected an integer >= 0", req.min_tokens)
    if req.stop_token_ids is not None and len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"Invalid 'stop_token_ids': at most {MAX_STOP_TOKEN_IDS} token ids.", "stop_token_ids")
    if req.stream_options is not None and not req.stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true.", "stream_options")
    if req.presence_penalty not in (None, 0.0):
        raise _unsupported("presence_penalty", "other than 0 is not supported")
    if req.frequency_penalty not in (None, 0.0):
        raise _unsupported("frequency_penalty", "other than 0 is not supported")
    if req.logit_bias:
        raise _unsupported("logit_bias")
    if isinstance(req, CompletionRequest):
        if req.best_of not in (None, 1):
            raise _unsupported("best_of", f"must be 1, got {req.best_of}")
        if req.suffix is not None:
            raise _unsupported("suffix")
    else:
        check_template_kwargs(req.chat_template_kwargs)


def logprobs_of(req: CompletionRequest | ChatCompletionRequest) -> tuple[int | None, int | None]:
    """(alternatives per generated token, per prompt token): None where the request asks for no log-probabilities.
    Completions: `logprobs` N for both (the prompt's only with `echo`); chat: `top_logprobs` with `logprobs`."""
    if isinstance(req, CompletionRequest):
        n = req.logprobs
        if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
            raise _range_error("logprobs", f"expected an integer between 0 and {MAX_TOP_LOGPROBS}", n)
        return n, (n if req.echo else None)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise _range_error(
                "top_logprobs", f"expected an integer between 0 and {MAX_TOP_LOGPROBS}", req.top_logprobs
            )
    return ((req.top_logprobs or 0) if req.logprobs else None), None


def scores_prompt_only(req: CompletionRequest | ChatCompletionRequest) -> bool:
    """A completions request with `echo` and `max_tokens: 0`: the prompt (and its log-probabilities), no tokens.
    (`max_tokens: 0` without `echo` is refused by `max_tokens_of`.)"""
    return isinstance(req, CompletionRequest) and req.echo and req.max_tokens == 0


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    taken = sorted(set(kwargs or {}) & set(TEMPLATE_VARIABLES))
    if taken:
        raise bad_request(
            f"Invalid 'chat_template_kwargs': {', '.join(repr(k) for k in taken)} cannot be given (the server "
            f"sets {', '.join(TEMPLATE_VARIABLES)}).",
            "chat_template_kwargs",
        )


def check_token_ids(ids: list[int], vocab_size: int | None, param: str) -> None:
    for i, t in enumerate(ids):
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            limit = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise bad_request(f"Invalid '{param}[{i}]': token id {t} is outside the vocabulary {limit}.", param)


def prompts_of(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completions request, each text or token ids (one prompt is a list of one)."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise bad_request("'prompt' must not be empty.", "prompt")
    if isinstance(p[0], int):
        return [p]  # type: ignore[list-item]
    return list(p)  # type: ignore[arg-type]


def messages_of(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as plain dicts for the chat template (text parts joined; `developer` is a system message; an
    assistant message's tool calls with their arguments as objects, as templates render them)."""
    if not messages:
        raise bad_request("'messages' must contain at least one message.", "messages")
    out = []
    for i, m in enumerate(messages):
        if m.content is None:
            content = ""
        elif isinstance(m.content, str):
            content = m.content
        else:
            content = "".join(part.text for part in m.content)
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls is not None:
            d["tool_calls"] = [_template_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(m.tool_calls)]
        out.append(d)
    return out


def _template_call(call: ToolCall, where: str) -> dict[str, Any]:
    try:
        args = json.loads(call.function.arguments)
    except ValueError:
        param = f"{where}.function.arguments"
        raise bad_request(f"'{param}' is not JSON.", param, "tool_arguments_not_json") from None
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": args}}

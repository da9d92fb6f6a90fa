"""OpenAI-compatible request bodies (pydantic) and helpers that build the one error type (stoker.errors.APIError).

Request models ignore unknown fields, as OpenAI's own SDKs may send newer
ones, but fields stoker knows and does not support are rejected by name.
Every integer is bounded so a hostile value is a 400 here, never a crash deeper down.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from stoker.control.policy import MIN_DEADLINE_S
from stoker.errors import APIError
from stoker.json_types import Boolean, Integer, Number
from stoker.models.tokenizer import TemplateVariableError
from stoker.server.bounds import (
    MAX_CHOICES,
    MAX_CONTENT_PARTS,
    MAX_EMBEDDING_INPUTS,
    MAX_EXTRA_FIELDS,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_NAME_CHARS,
    MAX_PROMPTS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPLATE_KWARGS,
    MAX_TOKEN_IDS,
    MAX_TOOLS,
    MAX_TOP_LOGPROBS,
)
from stoker.server.reasoning import ReasoningEffort, check_thinking_fields

INT32 = 2**31 - 1
# The largest 64-bit value a JSON double holds exactly (2**63 - 1 rounds up to
# 2**63 in a double, so a generator reading the schema as floats would overshoot).
MAX_SEED = 2**63 - 1024
Seed = Annotated[Integer, Field(ge=-(2**63), le=MAX_SEED)]
NonNegInt = Annotated[Integer, Field(ge=0, le=INT32)]
# Tagged fields get the served model's limits in /openapi.json (server/openapi.py).
TokenId = Annotated[Integer, Field(ge=0, le=INT32, json_schema_extra={"x-stoker": "token_id"})]
MaxTokens = Annotated[Integer, Field(ge=1, le=INT32, json_schema_extra={"x-stoker": "max_tokens"})]
ModelName = Annotated[str, Field(max_length=MAX_NAME_CHARS, json_schema_extra={"x-stoker": "model"})]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
TokenIds = Annotated[list[TokenId], Field(max_length=MAX_TOKEN_IDS)]
Float = Annotated[Number, Field(allow_inf_nan=False)]


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def template_error(exc: Exception) -> APIError:
    """400 for a chat template that refused a request's input (one of TEMPLATE_ERRORS)."""
    return bad_request(str(exc), param="chat_template_kwargs" if isinstance(exc, TemplateVariableError) else "messages")


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="service_unavailable", code="engine_unavailable", retry_after=1)


def deadline_exceeded(request_id: str) -> APIError:
    """504 for a request the engine dropped at its deadline before any token was sent."""
    return APIError(
        504,
        f"The request's deadline passed before it could be served (request {request_id}).",
        type="timeout",
        code="deadline_exceeded",
    )


def check_extra(model: BaseModel) -> None:
    """Unknown fields are ignored, but only so many of them (MAX_EXTRA_FIELDS)."""
    extra = model.model_extra or {}
    if len(extra) > MAX_EXTRA_FIELDS:
        raise ValueError(
            f"{len(extra)} fields this server does not know; at most {MAX_EXTRA_FIELDS} are accepted (and ignored)"
        )


class OpenObject(BaseModel):
    """A nested object that keeps unknown fields (chat templates may read them), a bounded number of them."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _bound_extra(self) -> OpenObject:
        check_extra(self)
        return self


class RequestBody(BaseModel):
    """A request body: unknown fields ignored, the known-unsupported ones (_unsupported) a 400 naming them."""

    # extra="allow" keeps unknown fields visible so known-unsupported ones can be named.
    model_config = ConfigDict(extra="allow", protected_namespaces=())

    _unsupported: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="after")
    def _reject_unsupported(self) -> RequestBody:
        check_extra(self)
        extra = self.model_extra or {}
        for name in self._unsupported:
            value = extra.get(name)
            if value not in (None, {}, [], False):
                raise ValueError(f"{name} is not supported by this server")
        return self


# Finite floats with OpenAI's and vLLM's ranges; the bounds appear in the OpenAPI schema.
Temperature = Annotated[Number, Field(ge=0.0, le=2.0, allow_inf_nan=False)]
UnitOpen = Annotated[Number, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
Unit = Annotated[Number, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Penalty = Annotated[Number, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
RepetitionPenalty = Annotated[Number, Field(gt=0.0, le=100.0, allow_inf_nan=False)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]
Choices = Annotated[list[str], Field(max_length=MAX_CHOICES)]
MAX_PRIORITY = 100
MAX_TIMEOUT_S = 86400.0


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema."""

    model_config = ConfigDict(populate_by_name=True)
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    """The JSON schema the reply must satisfy (omitted: any JSON value)."""
    strict: Boolean | None = None
    """Accepted for compatibility: stoker always enforces the whole schema, and
    answers 400 for a keyword it cannot enforce."""


class ResponseFormat(BaseModel):
    """text (the default), json_object (any JSON object) or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's newer form of the guided_* fields: exactly one of them."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Choices | None = None
    grammar: str | None = None
    json_object: Boolean | None = None


class SamplingFields(RequestBody):
    """Sampling fields shared by chat and completions (OpenAI names, then vLLM's
    extras), with the ranges OpenAI and vLLM accept. Everything the server
    checks without knowing the model is declared here, so the OpenAPI schema
    says what is accepted; what depends on the model (context length, vocabulary)
    is checked when the request is built and answered 400 naming the field."""

    model: ModelName | None = None
    """Model name; may be omitted when one model is served."""
    n: Annotated[Integer, Field(ge=1, le=64)] = 1
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: UnitOpen | None = None
    seed: Seed | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: (
        Annotated[
            dict[TokenIdKey, Annotated[Number, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]],
            Field(max_length=MAX_LOGIT_BIAS, json_schema_extra={"additionalProperties": False}),
        ]
        | None
    ) = None
    """Token id (as a string, as JSON keys are) to a bias added to its logit."""
    stream: Boolean = False
    stream_options: StreamOptions | None = None
    user: Name | None = None
    # vLLM extras
    top_k: Annotated[Integer, Field(ge=-1, le=INT32)] | None = None
    """-1 or 0 disables top-k."""
    min_p: Unit | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: Annotated[Integer, Field(ge=0, le=INT32, json_schema_extra={"x-stoker": "max_tokens"})] = 0
    ignore_eos: Boolean = False
    num_speculative_tokens: Annotated[Integer, Field(ge=0, le=16)] | None = None
    """stoker: most draft tokens per step for this request (0: no speculation; None: the server's setting)."""
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    skip_special_tokens: Boolean = True
    # structured output: OpenAI's response_format, vLLM's guided_* and structured_outputs
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    """A JSON schema (object or string) the output must satisfy."""
    guided_regex: str | None = None
    guided_choice: Choices | None = None
    guided_grammar: str | None = None
    """A Lark grammar (llguidance's dialect) or a GBNF grammar (llama.cpp's, with `root ::=`)."""
    structured_outputs: StructuredOutputs | None = None
    # stoker's scheduling fields
    priority: Annotated[Integer, Field(ge=-MAX_PRIORITY, le=MAX_PRIORITY)] | Literal["interactive", "batch"] | None = (
        None
    )
    """Lower is served first (0 interactive, 1 batch); a key's class caps how high a request may go."""
    timeout: Annotated[Number, Field(ge=MIN_DEADLINE_S, le=MAX_TIMEOUT_S, allow_inf_nan=False)] | None = None
    """Seconds the request may take; the engine drops or aborts it after that (504 if nothing was sent).
    At least 0.001: a shorter deadline cannot be met at all."""


class StreamOptions(BaseModel):
    include_usage: Boolean = False


MAX_BOOTSTRAP_ROOM = 2**64 - 1
MAX_HOST_CHARS = 253


class BootstrapFields(BaseModel):
    """sglang-router's PD mode (--pd-disaggregation) adds these to the body it sends to a prefill and a
    decode worker at once; they pair the two halves (docs/disaggregation.md). Ignored on --role both."""

    bootstrap_host: Annotated[str, Field(min_length=1, max_length=MAX_HOST_CHARS)] | None = None
    """The prefill worker's host, as the router knows it (the host of its --prefill URL)."""
    bootstrap_port: Annotated[Integer, Field(ge=1, le=65535)] | None = None
    """The prefill worker's KV transfer port (--prefill URL PORT); null: the decode worker's --kv-transfer-port."""
    bootstrap_room: Annotated[Integer, Field(ge=0, le=MAX_BOOTSTRAP_ROOM)] | None = None
    """The number both halves of one request carry."""

    @field_validator("bootstrap_room", mode="before")
    @classmethod
    def _one_room(cls, value: Any) -> Any:
        if isinstance(value, list):
            raise ValueError(
                "bootstrap_room must be one integer: a list of rooms (SGLang's batched /generate) is not supported"
            )
        return value


class TextPart(OpenObject):
    """Only text content parts are supported (no images or audio)."""

    type: Literal["text"]
    text: str


class ChatMessage(OpenObject):
    # Content may be absent only on an assistant turn (one that carries tool
    # calls): checked here for every route that takes messages, and stated in the schema.
    # Unknown keys (tool_calls, tool_call_id, ...) reach the chat template.
    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            "if": {"properties": {"role": {"const": "assistant"}}, "required": ["role"]},
            "else": {"properties": {"content": {"not": {"type": "null"}}}, "required": ["content"]},
        },
    )
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: Name | None = None
    reasoning_content: str | None = None
    """An assistant turn's thinking, as a thinking model's template reads it (Qwen3's keeps the latest turns')."""
    reasoning: str | None = None
    """The same under vLLM's newer name: taken as reasoning_content when that is not given."""

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required for role {self.role!r}")
        if self.reasoning_content is None and self.reasoning is not None:
            self.reasoning_content = self.reasoning
        return self


class FunctionDefinition(BaseModel):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """JSON schema of the arguments (omitted: an object with any properties)."""
    strict: Boolean | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: Name


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatTemplateFields(RequestBody):
    """Messages and how the model's chat template renders them (vLLM's names)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    add_generation_prompt: Boolean = True
    """End the prompt with the opening of an assistant turn, as the template writes it."""
    continue_final_message: Boolean = False
    """Leave the last message open so the reply continues it (a prefilled answer); needs add_generation_prompt false."""
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=MAX_TEMPLATE_KWARGS)] | None = None
    """Extra variables for the chat template, e.g. {"enable_thinking": false} for Qwen3's."""

    @model_validator(mode="after")
    def _check_template_fields(self) -> ChatTemplateFields:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be true: "
                "set add_generation_prompt to false to continue the last message"
            )
        return self


class ChatCompletionRequest(SamplingFields, ChatTemplateFields, BootstrapFields):
    # top_logprobs needs logprobs: true (as OpenAI and vLLM); said in the schema too.
    model_config = ConfigDict(
        json_schema_extra={
            "if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
            "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
        }
    )

    _unsupported: ClassVar[tuple[str, ...]] = (
        "functions",
        "function_call",
        "audio",
        "prediction",
        # Prompt scoring is a /v1/completions feature (echo + logprobs there).
        "echo",
        "prompt_logprobs",
        # A template from the client runs in the server: vLLM refuses it too unless trusted.
        "chat_template",
    )

    max_completion_tokens: MaxTokens | None = None
    """Newer OpenAI name for max_tokens; wins when both are given."""
    logprobs: Boolean = False
    top_logprobs: Annotated[Integer, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """Default: "auto" with tools, "none" without (as OpenAI)."""
    parallel_tool_calls: Boolean | None = None
    """With tool_choice "required": whether the reply may hold several calls (default true)."""
    reasoning_effort: ReasoningEffort | None = None
    """A thinking model's thinking budget by name (docs/reasoning.md's table); none: no thinking. Ignored by models that do not think."""
    reasoning_budget: Annotated[Integer, Field(ge=0, le=INT32)] | None = None
    """stoker: most thinking tokens for this reply (wins over reasoning_effort's); then the model answers. Default: --reasoning-budget."""

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        check_thinking_fields(self.reasoning_effort, self.chat_template_kwargs)
        return self


Prompt = (
    Annotated[str, Field(min_length=1)]
    | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
    | Annotated[list[TokenId], Field(min_length=1, max_length=MAX_TOKEN_IDS)]
    | Annotated[
        list[Annotated[list[TokenId], Field(min_length=1, max_length=MAX_TOKEN_IDS)]],
        Field(min_length=1, max_length=MAX_PROMPTS),
    ]
)
# The embedding model has a vocabulary of its own: its ids are not tagged.
EmbeddingInput = (
    str
    | Annotated[list[str], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    | Annotated[list[NonNegInt], Field(min_length=1, max_length=MAX_TOKEN_IDS)]
    | Annotated[
        list[Annotated[list[NonNegInt], Field(min_length=1, max_length=MAX_TOKEN_IDS)]],
        Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS),
    ]
)


def check_prompt_lengths(value: Any, field: str, max_items: int) -> Any:
    """The bound of the shape given (a list of ids or a list of prompts), named
    before the union's validation, which would name whichever branch it tried first."""
    if isinstance(value, list) and value:
        ids = isinstance(value[0], int)
        limit, what = (MAX_TOKEN_IDS, "token ids") if ids else (max_items, "items")
        if len(value) > limit:
            raise ValueError(f"{field} holds {len(value)} {what}; at most {limit} are accepted")
        for i, item in enumerate(value if not ids else ()):
            if isinstance(item, list) and len(item) > MAX_TOKEN_IDS:
                raise ValueError(f"{field}[{i}] holds {len(item)} token ids; at most {MAX_TOKEN_IDS} are accepted")
    return value


def chat_request_from(chat: dict[str, Any], param: str) -> ChatCompletionRequest:
    """The chat request another API's body becomes (Responses, Messages): what
    chat refuses is a 400 naming the field, under that API's `param`."""
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise bad_request(f"{param}: {where}: {first['msg']}", param=param) from None


class CompletionRequest(SamplingFields, BootstrapFields):
    _unsupported: ClassVar[tuple[str, ...]] = ("suffix",)

    prompt: Prompt
    max_tokens: Annotated[Integer, Field(ge=0, le=INT32, json_schema_extra={"x-stoker": "max_tokens"})] | None = None
    """0 (with echo) returns the prompt alone, e.g. to score it with logprobs."""
    echo: Boolean = False
    """Prepend the prompt to the text; with logprobs, the prompt tokens' logprobs too."""
    logprobs: Annotated[Integer, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    best_of: Annotated[Integer, Field(ge=1, le=64)] | None = None
    prompt_logprobs: Annotated[Integer, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    """vLLM extension: each prompt token's logprob, rank and this many top alternatives."""

    @field_validator("prompt", mode="before")
    @classmethod
    def _bounded_prompt(cls, value: Any) -> Any:
        return check_prompt_lengths(value, "prompt", MAX_PROMPTS)

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of different from n is not supported by this server")
        return self


class EmbeddingRequest(RequestBody):
    _unsupported: ClassVar[tuple[str, ...]] = ("dimensions",)

    model: Name | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    user: Name | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _bounded_input(cls, value: Any) -> Any:
        return check_prompt_lengths(value, "input", MAX_EMBEDDING_INPUTS)


class TokenizeCompletionRequest(RequestBody):
    model: ModelName | None = None
    prompt: str
    add_special_tokens: Boolean = True


class TokenizeChatRequest(ChatTemplateFields):
    _unsupported: ClassVar[tuple[str, ...]] = ("chat_template",)

    model: ModelName | None = None


# vLLM's shape: a prompt or chat messages (the schema's anyOf says exactly that).
TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class DetokenizeRequest(RequestBody):
    model: ModelName | None = None
    tokens: TokenIds


def flatten_prompts(prompt: Any) -> list[str | list[int]]:
    """The four OpenAI prompt forms as a list of single prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


SamplingFields.model_rebuild()

"""OpenAI-compatible request bodies (pydantic) and the error shape.

Request models ignore unknown fields, as OpenAI's own SDKs may send newer
ones, but fields stoker knows and does not support are rejected by name.
Every integer is bounded so a hostile value is a 400 here, never a crash deeper down.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

INT32 = 2**31 - 1
Int = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
PosInt = Annotated[int, Field(ge=1, le=INT32)]
NonNegInt = Annotated[int, Field(ge=0, le=INT32)]
TokenId = Annotated[int, Field(ge=0, le=INT32)]
Float = Annotated[float, Field(allow_inf_nan=False)]


class APIError(Exception):
    """An error rendered as {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="service_unavailable", code="engine_unavailable", headers={"Retry-After": "1"})


def deadline_exceeded(request_id: str) -> APIError:
    """504 for a request the engine dropped at its deadline before any token
    was sent (same shape as stoker.control.policy.deadline_exceeded_error)."""
    return APIError(
        504,
        f"The request's deadline passed before it could be served (request {request_id}).",
        type="timeout",
        code="deadline_exceeded",
    )


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class _Request(BaseModel):
    # extra="allow" keeps unknown fields visible so known-unsupported ones can be named.
    model_config = ConfigDict(extra="allow", protected_namespaces=())

    _unsupported: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="after")
    def _reject_unsupported(self) -> _Request:
        extra = self.model_extra or {}
        for name in self._unsupported:
            value = extra.get(name)
            if value not in (None, {}, [], False):
                raise ValueError(f"{name} is not supported by this server")
        return self


class SamplingFields(_Request):
    """Sampling fields shared by chat and completions (OpenAI names, then vLLM's extras)."""

    model: str | None = None
    """Model name; may be omitted when one model is served."""
    n: Annotated[int, Field(ge=1, le=64)] = 1
    max_tokens: PosInt | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: Annotated[int, Field(ge=-1, le=INT32)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0, allow_inf_nan=False)] | None = None
    min_tokens: NonNegInt = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    """Only text content parts are supported (no images or audio)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    _unsupported: ClassVar[tuple[str, ...]] = (
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "logit_bias",
        "audio",
        "prediction",
        # Prompt scoring is a /v1/completions feature (echo + logprobs there).
        "echo",
        "prompt_logprobs",
    )

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PosInt | None = None
    """Newer OpenAI name for max_tokens; wins when both are given."""
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise ValueError("response_format other than text is not supported by this server")
        return self


Prompt = (
    str
    | Annotated[list[str], Field(min_length=1)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
)


class CompletionRequest(SamplingFields):
    _unsupported: ClassVar[tuple[str, ...]] = ("suffix", "logit_bias")

    prompt: Prompt
    max_tokens: NonNegInt | None = None
    """0 (with echo) returns the prompt alone, e.g. to score it with logprobs."""
    echo: bool = False
    """Prepend the prompt to the text; with logprobs, the prompt tokens' logprobs too."""
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    best_of: Annotated[int, Field(ge=1, le=64)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    """vLLM extension: each prompt token's logprob, rank and this many top alternatives."""

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of different from n is not supported by this server")
        return self


class EmbeddingRequest(_Request):
    _unsupported: ClassVar[tuple[str, ...]] = ("dimensions",)

    model: str | None = None
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_of(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


def flatten_prompts(prompt: Any) -> list[str | list[int]]:
    """The four OpenAI prompt forms as a list of single prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


SamplingFields.model_rebuild()

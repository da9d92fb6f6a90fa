"""OpenAI's Responses API (POST /v1/responses) on top of chat: the request,
its translation into a chat request, and the response object and stream
events built from a finished or running sample.

Responses are kept in memory (responses_store.py) for previous_response_id
and GET/DELETE /v1/responses/{id}; background runs and conversations are
not offered (400 naming the field). Text input only; function tools only
(built-in tools such as web_search need OpenAI's servers).
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stoker.json_types import Boolean, Integer
from stoker.server.bounds import MAX_CONTENT_PARTS, MAX_INCLUDE, MAX_MESSAGES
from stoker.server.protocol import (
    ChatCompletionRequest,
    FunctionDefinition,
    MaxTokens,
    SamplingFields,
    chat_request_from,
)
from stoker.server.reasoning import ReasoningEffort
from stoker.server.serving.job import Usage


class InputText(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(BaseModel):
    """A message item (the "easy" form has no type)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | Annotated[list[InputText], Field(max_length=MAX_CONTENT_PARTS)]


class FunctionCallItem(BaseModel):
    """A call the model made earlier, sent back with the conversation."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    """The result of a call, for the model to read."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningText(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(BaseModel):
    """Thinking the model did earlier, sent back with the conversation: it goes
    to the assistant turn after it (as its reasoning_content)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["reasoning"]
    summary: Annotated[list[ReasoningText], Field(max_length=MAX_CONTENT_PARTS)] = []
    content: Annotated[list[ReasoningText], Field(max_length=MAX_CONTENT_PARTS)] | None = None


InputItem = FunctionCallItem | FunctionCallOutputItem | ReasoningItem | InputMessage


class ReasoningOptions(BaseModel):
    """reasoning: how much a thinking model thinks (docs/reasoning.md)."""

    model_config = ConfigDict(extra="allow")
    effort: ReasoningEffort | None = None
    """As chat's reasoning_effort: a thinking budget by name; none: no thinking."""
    summary: Literal["auto", "concise", "detailed"] | None = None
    """Accepted: stoker writes no summary; the reasoning item carries the thinking itself."""


class FunctionTool(FunctionDefinition):
    """The Responses API's function tool: chat's function fields, flattened."""

    type: Literal["function"]


class NamedFunctionChoice(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """text.format: plain text, any JSON object, or JSON valid for a schema."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: Boolean | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("text.format of type json_schema needs a schema")
        return self


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: TextFormat | None = None


METADATA_PAIRS = 16
METADATA_KEY_CHARS = 64
METADATA_VALUE_CHARS = 512
"""OpenAI's limits on a response's metadata: it is stored and given back, so it is bounded."""


def check_metadata(metadata: dict[str, str] | None) -> dict[str, str] | None:
    """metadata within OpenAI's limits, else ValueError naming the limit (400 on metadata)."""
    if metadata is None:
        return None
    if len(metadata) > METADATA_PAIRS:
        raise ValueError(f"at most {METADATA_PAIRS} key-value pairs, got {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS:
            raise ValueError(f"keys are at most {METADATA_KEY_CHARS} characters, got one of {len(key)}")
        if len(value) > METADATA_VALUE_CHARS:
            raise ValueError(
                f"values are at most {METADATA_VALUE_CHARS} characters, got one of {len(value)} (key {key!r})"
            )
    return metadata


class ResponsesRequest(SamplingFields):
    _unsupported: ClassVar[tuple[str, ...]] = (
        # no background runs, no conversation objects
        "conversation",
        "background",
        "prompt",
        "max_tool_calls",
    )

    input: (
        Annotated[str, Field(min_length=1)] | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]
    )
    previous_response_id: str | None = None
    """A stored response this one continues: its input and output come before this input."""
    instructions: str | None = None
    """A system message put before the input."""
    max_output_tokens: MaxTokens | None = None
    text: TextOptions | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: Boolean | None = None
    store: Boolean | None = None
    """Keep the response for previous_response_id and GET /v1/responses/{id} (default true, as OpenAI)."""
    metadata: dict[str, str] | None = None
    """Given back on the response (and stored with it): at most 16 pairs, keys up to 64 characters, values up to 512."""
    truncation: Literal["disabled"] | None = None
    """Only "disabled": an input beyond the context is a 400, never cut."""
    include: Annotated[list[Literal["message.output_text.logprobs"]], Field(max_length=MAX_INCLUDE)] | None = None
    """Extra output: "message.output_text.logprobs", each output token's logprob (with top_logprobs alternatives)."""
    top_logprobs: Annotated[Integer, Field(ge=0, le=20)] | None = None
    reasoning: ReasoningOptions | None = None

    @property
    def wants_logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or []) or self.top_logprobs is not None

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return check_metadata(value)

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        if self.n != 1:
            raise ValueError("n is not supported by the Responses API (one output per response)")
        if self.response_format is not None and self.text is not None and self.text.format is not None:
            raise ValueError("give text.format or response_format, not both")
        return self


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as chat messages (calls and their outputs as tool turns), without its instructions."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[dict[str, Any]] = []
    thinking: list[str] = []  # reasoning items waiting for the assistant turn they belong to
    for item in body.input:
        if isinstance(item, ReasoningItem):
            thinking += [part.text for part in item.content or item.summary]
            continue
        if isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            if thinking:
                messages[-1]["reasoning_content"] = "".join(thinking)
                thinking = []
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        else:
            content = (
                item.content
                if isinstance(item.content, str)
                else [{"type": "text", "text": part.text} for part in item.content]
            )
            messages.append({"role": item.role, "content": content})
            if item.role == "assistant" and thinking:
                messages[-1]["reasoning_content"] = "".join(thinking)
                thinking = []
    return messages


def as_chat_request(body: ResponsesRequest, earlier: list[dict[str, Any]] | None = None) -> ChatCompletionRequest:
    """The chat request that serves this response: the same sampling fields;
    messages from the instructions, the conversation so far (earlier: a
    previous response's) and the input; chat's shapes for tools and the
    output format."""
    fields = {name: getattr(body, name) for name in SamplingFields.model_fields if name in body.model_fields_set}
    fields.pop("stream", None)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat: dict[str, Any] = {**fields, "messages": [*system, *(earlier or []), *input_messages(body)]}
    if body.max_output_tokens is not None:
        chat["max_tokens"] = body.max_output_tokens
    if body.wants_logprobs:
        chat |= {"logprobs": True, "top_logprobs": body.top_logprobs or 0}
    if body.tools:
        chat["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in body.tools
        ]
    if isinstance(body.tool_choice, NamedFunctionChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    if body.parallel_tool_calls is not None:
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    if body.reasoning is not None and body.reasoning.effort is not None:
        chat["reasoning_effort"] = body.reasoning.effort
    text_format = body.text.format if body.text is not None else None
    if text_format is not None and text_format.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif text_format is not None and text_format.type == "json_schema":
        schema = {"name": text_format.name or "output", "schema": text_format.schema_, "strict": text_format.strict}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    return chat_request_from(chat, "input")


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [output_text(text, logprobs)] if status == "completed" else [],
    }


def output_text(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A text part; logprobs as chat's logprobs.content entries (token, logprob, bytes, top_logprobs)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """The thinking as OpenAI's reasoning output item: its text whole, no summary."""
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def function_call_item(call: dict[str, Any]) -> dict[str, Any]:
    """A chat tool call as a function_call output item."""
    return {
        "type": "function_call",
        "id": new_item_id("fc"),
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": "completed",
    }


def usage(chat_usage: Usage) -> dict[str, Any]:
    """Chat's usage under the Responses API's names."""
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {
            "reasoning_tokens": chat_usage.get("completion_tokens_details", {"reasoning_tokens": 0})["reasoning_tokens"]
        },
        "total_tokens": chat_usage["total_tokens"],
    }


def status_of(finish_reason: str | None) -> tuple[str, dict[str, Any] | None]:
    """The response's status and incomplete_details from its sample's finish reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":  # its deadline (timeout) passed during generation
        return "incomplete", {"reason": "timeout"}
    return "completed", None


def response_object(
    body: ResponsesRequest,
    response_id: str,
    created: int,
    model: str,
    output: list[dict[str, Any]],
    status: str,
    incomplete: dict[str, Any] | None = None,
    chat_usage: Usage | None = None,
    stored: bool = False,
) -> dict[str, Any]:
    """The Response: what was generated, and the request's settings as applied."""
    text_format = body.text.format if body.text is not None and body.text.format is not None else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
        "reasoning": {
            "effort": body.reasoning.effort if body.reasoning else None,
            "summary": body.reasoning.summary if body.reasoning else None,
        },
        "previous_response_id": body.previous_response_id,
        "store": stored,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {
            "format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format else {"type": "text"}
        },
        "tool_choice": (
            body.tool_choice.model_dump()
            if isinstance(body.tool_choice, NamedFunctionChoice)
            else body.tool_choice or ("auto" if body.tools else "none")
        ),
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": "disabled",
        "usage": usage(chat_usage) if chat_usage is not None else None,
        "user": body.user,
        "metadata": body.metadata or {},
    }

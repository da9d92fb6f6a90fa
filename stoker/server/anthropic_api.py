"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) on
top of chat: the request, its translation into a chat request, and the
message built from a finished sample, as vLLM offers it for clients such as
the anthropic SDK.

Text, tools, JSON output (output_config.format, the SDK's messages.parse) and
a thinking model's thinking (the `thinking` parameter, thinking blocks;
docs/reasoning.md); image and document blocks and server tools are a 400
naming the field. Errors keep stoker's one error body
({"error": {"message", "type", ...}}), which the anthropic SDK reads by its
status code and message as well.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stoker.json_types import Boolean, Integer
from stoker.server.bounds import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_STOP_STRINGS
from stoker.server.protocol import (
    INT32,
    ChatCompletionRequest,
    FunctionDefinition,
    MaxTokens,
    ModelName,
    RequestBody,
    StopString,
    Temperature,
    UnitOpen,
    bad_request,
    chat_request_from,
)
from stoker.server.reasoning import signature
from stoker.server.serving.job import Usage


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    """A call the assistant made (in its earlier turns)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    """The result of a call, in a user turn."""

    model_config = ConfigDict(extra="allow")
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | Annotated[list[TextBlock], Field(max_length=MAX_CONTENT_PARTS)] = ""
    is_error: Boolean | None = None


class ThinkingBlock(BaseModel):
    """Thinking the assistant did (in its earlier turns): its template may show it again."""

    model_config = ConfigDict(extra="allow")
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    """Accepted as sent, not checked (docs/reasoning.md)."""


class RedactedThinkingBlock(BaseModel):
    """Thinking another server encrypted: accepted, and left out of the prompt."""

    model_config = ConfigDict(extra="allow")
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock


class ThinkingConfig(BaseModel):
    """thinking: a thinking model thinks within budget_tokens (enabled), not at
    all (disabled), or as it would (adaptive). Models that do not think ignore it."""

    model_config = ConfigDict(extra="allow")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[Integer, Field(ge=1, le=INT32)] | None = None
    """With enabled, required: most thinking tokens, below max_tokens (Anthropic's own minimum of 1024 is not kept)."""

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> ThinkingConfig:
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("thinking of type enabled needs budget_tokens")
        if self.type != "enabled" and self.budget_tokens is not None:
            raise ValueError(f"thinking of type {self.type} takes no budget_tokens")
        return self


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant"]
    content: str | Annotated[list[ContentBlock], Field(max_length=MAX_CONTENT_PARTS)]


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: Boolean | None = None


class JsonOutputFormat(BaseModel):
    """output_config.format: the reply is JSON that satisfies this schema (the SDK's messages.parse)."""

    model_config = ConfigDict(populate_by_name=True)
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: JsonOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    """Accepted and ignored: a thinking model's budget is thinking.budget_tokens here."""


ANTHROPIC_USER_ID_CHARS = 256
"""Anthropic's limit on metadata.user_id."""


class Metadata(BaseModel):
    """Anthropic's metadata: only user_id (passed on as chat's `user`); other keys are refused, as Anthropic does."""

    model_config = ConfigDict(extra="forbid")
    user_id: Annotated[str, Field(max_length=ANTHROPIC_USER_ID_CHARS)] | None = None


class MessagesRequest(RequestBody):
    _unsupported: ClassVar[tuple[str, ...]] = ("mcp_servers", "container")

    model: ModelName | None = None
    max_tokens: MaxTokens
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: str | Annotated[list[TextBlock], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: Temperature | None = None
    top_p: UnitOpen | None = None
    top_k: Annotated[Integer, Field(ge=-1)] | None = None
    stream: Boolean = False
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    thinking: ThinkingConfig | None = None

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> MessagesRequest:
        budget = self.thinking.budget_tokens if self.thinking is not None else None
        if budget is not None and budget >= self.max_tokens:
            raise ValueError(f"thinking.budget_tokens ({budget}) must be less than max_tokens ({self.max_tokens})")
        return self


class CountTokensRequest(RequestBody):
    """count_tokens takes the request's prompt half."""

    _unsupported: ClassVar[tuple[str, ...]] = ("mcp_servers",)

    model: ModelName | None = None
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: str | Annotated[list[TextBlock], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(block.text for block in content)


def chat_messages(body: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages: system first; a user turn's tool
    results become tool messages (before its text), an assistant turn's
    tool_use blocks its tool_calls."""
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": _text(body.system)})
    for message in body.messages:
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        texts = [block.text for block in message.content if isinstance(block, TextBlock)]
        if message.role == "assistant":
            calls = [
                {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                for b in message.content
                if isinstance(b, ToolUseBlock)
            ]
            turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or (None if calls else "")}
            thinking = "".join(b.thinking for b in message.content if isinstance(b, ThinkingBlock))
            if thinking:
                turn["reasoning_content"] = thinking
            messages.append({**turn, "tool_calls": calls} if calls else turn)
            continue
        for block in message.content:
            if isinstance(block, ToolResultBlock):
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _text(block.content)})
            elif isinstance(block, ToolUseBlock | ThinkingBlock | RedactedThinkingBlock):
                raise bad_request(f"{block.type} blocks belong to assistant turns", param="messages")
        if texts:
            messages.append({"role": "user", "content": "".join(texts)})
    return messages


def as_chat_request(body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that serves this message (or counts its prompt)."""
    chat: dict[str, Any] = {"model": body.model, "messages": chat_messages(body)}
    if body.thinking is not None and body.thinking.type == "disabled":
        chat["reasoning_effort"] = "none"
    elif body.thinking is not None and body.thinking.budget_tokens is not None:
        chat["reasoning_budget"] = body.thinking.budget_tokens
    if isinstance(body, MessagesRequest):
        chat["max_tokens"] = body.max_tokens
        for name in ("temperature", "top_p", "top_k"):
            if getattr(body, name) is not None:
                chat[name] = getattr(body, name)
        if body.stop_sequences:
            chat["stop"] = body.stop_sequences
        if body.metadata is not None and body.metadata.user_id is not None:
            chat["user"] = body.metadata.user_id
        if body.output_config is not None and body.output_config.format is not None:
            schema = body.output_config.format.schema_
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    if body.tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": FunctionDefinition(
                    name=tool.name, description=tool.description, parameters=tool.input_schema
                ).model_dump(exclude_none=True),
            }
            for tool in body.tools
        ]
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise bad_request("tool_choice of type tool needs a name", param="tool_choice")
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    return chat_request_from(chat, "messages")


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    """A chat tool call as a tool_use content block (its arguments parsed: Anthropic sends an object)."""
    try:
        arguments = json.loads(call["function"]["arguments"])
    except json.JSONDecodeError:
        arguments = {}
    return {
        "type": "tool_use",
        "id": call["id"],
        "name": call["function"]["name"],
        "input": arguments if isinstance(arguments, dict) else {"value": arguments},
    }


def thinking_block(thinking: str) -> dict[str, Any]:
    """A reply's thinking as a thinking content block, signed (stoker.server.reasoning.signature)."""
    return {"type": "thinking", "thinking": thinking, "signature": signature(thinking)}


def stop_reason(finish_reason: str | None, matched: int | str | None, called: bool) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence from the sample's finish."""
    if called:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def usage(chat_usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "output_tokens": chat_usage["completion_tokens"],
        "cache_read_input_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"],
        "cache_creation_input_tokens": 0,
    }

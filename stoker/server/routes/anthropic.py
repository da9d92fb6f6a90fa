"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API,
served as a chat request (stoker/server/anthropic_api.py translates)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from stoker.engine.params import CompletionOutput, EngineCoreOutput
from stoker.server.anthropic_api import (
    CountTokensRequest,
    MessagesRequest,
    as_chat_request,
    stop_reason,
    thinking_block,
    tool_use_block,
    usage,
)
from stoker.server.bounds import offload
from stoker.server.fallback import serve_from_chain
from stoker.server.fleet import ModelVersion
from stoker.server.reasoning import signature
from stoker.server.serving import JSONObject
from stoker.server.serving.generate import STREAMED, Generation, Renderer, generate, named_sse
from stoker.server.serving.job import Job
from stoker.server.serving.prompt import chat_job, chat_prompt_ids
from stoker.server.state import ServerState, admitted, get_state, run_before_hooks
from stoker.server.tools import ToolPlan, parse_reply, plan_tools

router = APIRouter(dependencies=[Depends(run_before_hooks)])


@router.post("/v1/messages", responses=STREAMED)
async def create_message(body: MessagesRequest, request: Request) -> Response:
    state = get_state(request)
    return await serve_from_chain(state, body.model, lambda version: message_attempt(body, request, state, version))


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> JSONObject:
    """The prompt's tokens as /v1/messages would render it (tools included)."""
    version = get_state(request).version_for(body.model)
    async with admitted(request, "count_tokens", version.name):
        chat = as_chat_request(body)
        tokenizer = version.tokenizer
        ids = await offload(lambda: chat_prompt_ids(chat, tokenizer, plan_tools(chat, None, tokenizer)))
    return {"input_tokens": len(ids)}


async def message_attempt(
    body: MessagesRequest, request: Request, state: ServerState, version: ModelVersion
) -> Response:
    chat = as_chat_request(body)
    job, plan = await chat_job(chat, version, "messages", state.config.reasoning_budget)
    return await generate(Generation(request, state, version, job, MessageRenderer(plan), body.stream, chat))


@dataclass
class MessageRenderer(Renderer):
    """A message, or its stream events. Plain text streams as it comes; a reply
    that may hold tool calls is parsed once finished, then sent block by block."""

    plan: ToolPlan
    started: bool = False
    """message_start went out."""
    thinking: Literal["no", "open", "closed"] = "no"
    """The thinking block (index 0): not sent, open with its text going out as it comes, or done."""
    streaming_text: bool = False
    """A text block is open and its text goes out as it comes."""

    end_of_stream = None

    def frame(self, event: JSONObject) -> str:
        return named_sse(event)

    def content_of(self, sample: CompletionOutput) -> tuple[list[JSONObject], str, str | None]:
        """The sample's content blocks, stop_reason and stop_sequence."""
        text, calls = parse_reply(sample.text, self.plan)
        blocks = [thinking_block(sample.reasoning_text)] if sample.reasoning_text else []
        blocks += [{"type": "text", "text": text}] if text or not calls else []
        blocks += [tool_use_block(call) for call in calls]
        finish = sample.finish_reason.value if sample.finish_reason else None
        reason, sequence = stop_reason(finish, sample.stop_reason, bool(calls))
        return blocks, reason, sequence

    def message(self, job: Job, content: list[JSONObject], reason: str | None, sequence: str | None) -> JSONObject:
        return {
            "id": f"msg_{job.request_id}",
            "type": "message",
            "role": "assistant",
            "model": job.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage(job.usage()),
        }

    def final(self, job: Job) -> JSONObject:
        return self.message(job, *self.content_of(job.outputs[0].outputs[0]))

    def thinking_events(self, job: Job, d: EngineCoreOutput) -> list[JSONObject]:
        """The thinking block as the thinking comes, signed and closed when the answer starts."""
        events: list[JSONObject] = []
        if d.new_reasoning_text:
            if self.thinking == "no":
                self.thinking = "open"
                opened = {"type": "thinking", "thinking": "", "signature": ""}
                events.append({"type": "content_block_start", "index": 0, "content_block": opened})
            delta = {"type": "thinking_delta", "thinking": d.new_reasoning_text}
            events.append({"type": "content_block_delta", "index": 0, "delta": delta})
        if self.thinking == "open" and (d.new_text or d.finished):
            self.thinking = "closed"
            signed = {"type": "signature_delta", "signature": signature(job.outputs[0].outputs[0].reasoning_text)}
            events += [
                {"type": "content_block_delta", "index": 0, "delta": signed},
                {"type": "content_block_stop", "index": 0},
            ]
        return events

    def events(self, job: Job, prompt_index: int, d: EngineCoreOutput) -> list[JSONObject]:
        events: list[JSONObject] = []
        if not self.started:
            self.started = True
            opening = self.message(job, [], None, None)
            opening["usage"]["output_tokens"] = 0
            events += [{"type": "message_start", "message": opening}, {"type": "ping"}]
        events += self.thinking_events(job, d)
        at = 0 if self.thinking == "no" else 1  # the text follows the thinking block
        if not self.plan.active and not self.streaming_text and (d.new_text or d.finished):
            self.streaming_text = True
            events.append({"type": "content_block_start", "index": at, "content_block": {"type": "text", "text": ""}})
        if not self.plan.active and d.new_text:
            events.append(
                {"type": "content_block_delta", "index": at, "delta": {"type": "text_delta", "text": d.new_text}}
            )
        if not d.finished:
            return events
        blocks, reason, sequence = self.content_of(job.outputs[0].outputs[0])
        for index, block in enumerate(blocks):
            if block["type"] == "thinking":  # streamed as it came
                continue
            if block["type"] == "text" and self.streaming_text:
                events.append({"type": "content_block_stop", "index": index})
                continue
            opened: JSONObject
            if block["type"] == "text":
                opened, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
            else:
                opened = {**block, "input": {}}
                delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
            events += [
                {"type": "content_block_start", "index": index, "content_block": opened},
                {"type": "content_block_delta", "index": index, "delta": delta},
                {"type": "content_block_stop", "index": index},
            ]
        events += [
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {"output_tokens": job.usage()["completion_tokens"]},
            },
            {"type": "message_stop"},
        ]
        return events

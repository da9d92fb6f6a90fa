"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API,
served as a chat request (stoker/server/anthropic_api.py translates)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from stoker.engine.params import CompletionOutput, EngineCoreOutput
from stoker.server.anthropic_api import (
    CountTokensRequest,
    MessagesRequest,
    as_chat_request,
    stop_reason,
    tool_use_block,
    usage,
)
from stoker.server.bounds import offload
from stoker.server.fallback import serve_from_chain
from stoker.server.fleet import ModelVersion
from stoker.server.routes.openai import STREAMED, chat_job, chat_prompt_ids, run
from stoker.server.serving import Job, sse
from stoker.server.state import ServerState, admitted, get_state, run_before_hooks
from stoker.server.tools import parse_reply, plan_tools

router = APIRouter(dependencies=[Depends(run_before_hooks)])


@router.post("/v1/messages", responses=STREAMED)
async def create_message(body: MessagesRequest, request: Request) -> Response:
    state = get_state(request)
    return await serve_from_chain(state, body.model, lambda version: message_attempt(body, request, state, version))


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, Any]:
    """The prompt's tokens as /v1/messages would render it (tools included)."""
    version = get_state(request).version_for(body.model)
    async with admitted(request, "count_tokens", version.name):
        chat = as_chat_request(body)
        tokenizer = version.tokenizer
        ids = await offload(lambda: chat_prompt_ids(chat, tokenizer, plan_tools(chat, None, tokenizer)))
    return {"input_tokens": len(ids)}


def named_sse(event: dict[str, Any]) -> str:
    """A stream event as Anthropic writes them: its type on the event line too."""
    return f"event: {event['type']}\n{sse(event)}"


async def message_attempt(
    body: MessagesRequest, request: Request, state: ServerState, version: ModelVersion
) -> Response:
    chat = as_chat_request(body)
    job, plan = await chat_job(chat, version, "messages")
    streaming_text = False  # a text block is open and its text goes out as it comes
    started = False

    def message_id() -> str:
        return f"msg_{job.request_id}"

    def content_of(sample: CompletionOutput) -> tuple[list[dict[str, Any]], str, str | None]:
        """The sample's content blocks, stop_reason and stop_sequence."""
        text, calls = parse_reply(sample.text, plan)
        blocks = [{"type": "text", "text": text}] if text or not calls else []
        blocks += [tool_use_block(call) for call in calls]
        finish = sample.finish_reason.value if sample.finish_reason else None
        reason, sequence = stop_reason(finish, sample.stop_reason, bool(calls))
        return blocks, reason, sequence

    def message(content: list[dict[str, Any]], reason: str | None, sequence: str | None) -> dict[str, Any]:
        return {
            "id": message_id(),
            "type": "message",
            "role": "assistant",
            "model": job.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage(job.usage()),
        }

    def render_final(job: Job) -> dict[str, Any]:
        return message(*content_of(job.outputs[0].outputs[0]))

    def render_delta(job: Job, _prompt: int, d: EngineCoreOutput, _head: dict[str, Any]) -> list[dict[str, Any]]:
        """Plain text streams as it comes; a reply that may hold tool calls is
        parsed once finished, then sent block by block."""
        nonlocal started, streaming_text
        events: list[dict[str, Any]] = []
        if not started:
            started = True
            opening = message([], None, None)
            opening["usage"]["output_tokens"] = 0
            events += [{"type": "message_start", "message": opening}, {"type": "ping"}]
        if not plan.active and not streaming_text and (d.new_text or d.finished):
            streaming_text = True
            events.append({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
        if not plan.active and d.new_text:
            events.append(
                {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": d.new_text}}
            )
        if not d.finished:
            return events
        blocks, reason, sequence = content_of(job.outputs[0].outputs[0])
        for index, block in enumerate(blocks):
            if block["type"] == "text" and streaming_text:
                events.append({"type": "content_block_stop", "index": index})
                continue
            opened: dict[str, Any]
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

    return await run(
        request,
        state,
        version,
        job,
        body.stream,
        False,
        render_delta,
        render_final,
        "message",
        chat,
        frame=named_sse,
        done_marker=False,
    )

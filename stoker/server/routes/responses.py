"""POST /v1/responses: OpenAI's Responses API, served as a chat request
(stoker/server/responses_api.py translates both ways); GET and DELETE
/v1/responses/{id} for the stored ones (stoker/server/responses_store.py).

A response's id is `resp_` + the server's own request id, and a stored one is
its caller's key's alone: another key's id reads as an unknown one everywhere
(previous_response_id, GET, DELETE)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from stoker.engine.params import CompletionOutput, EngineCoreOutput, TokenLogprob
from stoker.errors import APIError
from stoker.server.bounds import offload
from stoker.server.fallback import serve_from_chain
from stoker.server.fleet import ModelVersion
from stoker.server.protocol import bad_request
from stoker.server.responses_api import (
    ResponsesRequest,
    as_chat_request,
    function_call_item,
    input_messages,
    message_item,
    new_item_id,
    output_text,
    reasoning_item,
    response_object,
    status_of,
)
from stoker.server.responses_store import ResponseStore, StoredResponse, output_messages
from stoker.server.serving import JSONObject
from stoker.server.serving.generate import STREAMED, Generation, Renderer, generate, named_sse
from stoker.server.serving.job import Job
from stoker.server.serving.logprobs import token_entries
from stoker.server.serving.prompt import chat_job
from stoker.server.state import ServerState, get_state, run_before_hooks
from stoker.server.tools import ToolPlan, parse_reply

router = APIRouter(dependencies=[Depends(run_before_hooks)])


@router.post("/v1/responses", responses=STREAMED)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    state = get_state(request)
    earlier: list[JSONObject] = []
    if body.previous_response_id is not None:
        previous = state.responses.get(body.previous_response_id, key_id(request))
        if previous is None:
            raise bad_request(
                f"Previous response with id '{body.previous_response_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        earlier = previous.conversation
    held = [*earlier, *input_messages(body)]
    # Measuring grows with the body: off the event loop, like tokenizing.
    store = state.responses.enabled and body.store is not False and await offload(fits_store, body, held, state)
    return await serve_from_chain(
        state, body.model, lambda version: response_attempt(body, earlier, held, store, request, state, version)
    )


def fits_store(body: ResponsesRequest, held: list[JSONObject], state: ServerState) -> bool:
    """Whether a response to body can be stored, as far as its input tells: an
    input (with what it continues) already over the entry bound is answered
    unstored ("store": false), or refused if the client asked for store: true,
    since that cannot be done. The output may still push it over (then it is
    answered with "store": false at the end)."""
    snapshot = response_object(body, "resp_", 0, body.model or "", [], "in_progress", stored=True)
    if state.responses.fits(snapshot, held):
        return True
    if body.store is True:
        limit = state.responses.max_entry_bytes
        raise bad_request(
            f"store: this response cannot be stored: its input (with the conversation it continues) is over "
            f"{limit} bytes, the most a stored response may hold (--responses-store-entry-bytes); "
            "send store: false to have it answered unstored.",
            param="store",
            code="response_too_large_to_store",
        )
    return False


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> JSONObject:
    """A stored response, as it was answered."""
    entry = get_state(request).responses.get(response_id, key_id(request))
    if entry is None:
        raise not_found(response_id)
    return entry.response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> JSONObject:
    if not get_state(request).responses.delete(response_id, key_id(request)):
        raise not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def key_id(request: Request) -> str | None:
    """The caller's API key id (None in open mode): stored responses are its own."""
    key = getattr(request.state, "api_key", None)
    return getattr(key, "id", None)


def not_found(response_id: str) -> APIError:
    return APIError(404, f"No response with id '{response_id}' found.", param="response_id", code="not_found")


def token_logprobs(version: ModelVersion, items: list[TokenLogprob] | None) -> list[JSONObject]:
    """Tokens' logprobs as an output_text part carries them (chat's entries)."""
    return token_entries(version, items) if items is not None else []


def reply_output(
    sample: CompletionOutput, plan: ToolPlan, message_id: str, version: ModelVersion, reasoning_id: str
) -> list[JSONObject]:
    """The output items of a finished sample: its thinking, if any, as a
    reasoning item; its text as a message (unless it is only calls; with its
    tokens' logprobs where asked, unless calls were cut out of it), then each
    function call (parsed from the answer alone)."""
    content, calls = parse_reply(sample.text, plan)
    logprobs = token_logprobs(version, sample.logprobs) if not calls else None
    items = [reasoning_item(reasoning_id, sample.reasoning_text, "completed")] if sample.reasoning_text else []
    items += [message_item(message_id, content or "", "completed", logprobs)] if content or not calls else []
    return items + [function_call_item(call) for call in calls]


async def response_attempt(
    body: ResponsesRequest,
    earlier: list[JSONObject],
    held: list[JSONObject],
    store: bool,
    request: Request,
    state: ServerState,
    version: ModelVersion,
) -> Response:
    """held: earlier and this input as chat messages; store: whether to keep the
    response (the request allows it and its input fits)."""
    job, plan = await chat_job(as_chat_request(body, earlier), version, "responses", state.config.reasoning_budget)
    renderer = ResponseRenderer(body, held, store, key_id(request), state.responses, version, plan)
    return await generate(Generation(request, state, version, job, renderer, body.stream, body))


@dataclass
class ResponseRenderer(Renderer):
    """A response, or its stream events. Plain text streams as it comes; a reply
    that may hold tool calls is parsed once finished, then sent item by item (as
    chat streams it)."""

    body: ResponsesRequest
    held: list[JSONObject]
    """The conversation so far (earlier responses and this input) as chat messages."""
    store: bool
    """Whether to keep the response (the request allows it and its input fits)."""
    owner: str | None
    """The key the stored response belongs to."""
    responses: ResponseStore
    version: ModelVersion
    plan: ToolPlan
    message_id: str = field(default_factory=lambda: new_item_id("msg"))
    reasoning_id: str = field(default_factory=lambda: new_item_id("rs"))
    sequence: Iterator[int] = field(default_factory=itertools.count)
    started: bool = False
    """response.created went out."""
    streaming_text: bool = False
    """The message item is open and its text goes out as it comes."""
    thinking: Literal["no", "open", "closed"] = "no"
    """The reasoning item (output 0): not sent, open with its text going out as it comes, or done."""

    end_of_stream = None

    def frame(self, event: JSONObject) -> str:
        return named_sse(event)

    def finished(self, job: Job, sample: CompletionOutput) -> JSONObject:
        """The response once its sample is done, stored unless the request said
        not to or it is over the entry bound ("store" says which)."""
        status, incomplete = status_of(sample.finish_reason.value if sample.finish_reason else None)
        output = reply_output(sample, self.plan, self.message_id, self.version, self.reasoning_id)
        response = response_object(
            self.body,
            response_id(job),
            job.created,
            job.model,
            output,
            status,
            incomplete,
            job.usage(),
            stored=self.store,
        )
        if self.store:
            kept = StoredResponse(response, [*self.held, *output_messages(output)], self.owner)
            response["store"] = self.responses.put(kept)
        return response

    def final(self, job: Job) -> JSONObject:
        return self.finished(job, job.outputs[0].outputs[0])

    def event(self, kind: str, **fields: object) -> JSONObject:
        return {"type": kind, "sequence_number": next(self.sequence), **fields}

    def opening(self, job: Job) -> list[JSONObject]:
        snapshot = response_object(
            self.body, response_id(job), job.created, job.model, [], "in_progress", stored=self.store
        )
        return [
            self.event("response.created", response=snapshot),
            self.event("response.in_progress", response=snapshot),
        ]

    def open_message(self, index: int, item_id: str) -> list[JSONObject]:
        return [
            self.event("response.output_item.added", output_index=index, item=message_item(item_id, "", "in_progress")),
            self.event(
                "response.content_part.added",
                item_id=item_id,
                output_index=index,
                content_index=0,
                part=output_text(""),
            ),
        ]

    def text_delta(self, index: int, item_id: str, text: str, logprobs: list[JSONObject]) -> JSONObject:
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        return self.event("response.output_text.delta", **where, delta=text, logprobs=logprobs)

    def close_message(self, index: int, item: JSONObject) -> list[JSONObject]:
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        part = item["content"][0]
        return [
            self.event("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"]),
            self.event("response.content_part.done", **where, part=part),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def call_events(self, index: int, item: JSONObject) -> list[JSONObject]:
        where = {"item_id": item["id"], "output_index": index}
        opened = {**item, "arguments": "", "status": "in_progress"}
        return [
            self.event("response.output_item.added", output_index=index, item=opened),
            self.event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
            self.event("response.function_call_arguments.done", **where, arguments=item["arguments"]),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def open_thinking(self) -> list[JSONObject]:
        item = reasoning_item(self.reasoning_id, "", "in_progress")
        where = {"item_id": self.reasoning_id, "output_index": 0, "content_index": 0}
        return [
            self.event("response.output_item.added", output_index=0, item=item),
            self.event("response.content_part.added", **where, part={"type": "reasoning_text", "text": ""}),
        ]

    def close_thinking(self, text: str) -> list[JSONObject]:
        item = reasoning_item(self.reasoning_id, text, "completed")
        where = {"item_id": self.reasoning_id, "output_index": 0, "content_index": 0}
        return [
            self.event("response.reasoning_text.done", **where, text=text),
            self.event("response.content_part.done", **where, part=item["content"][0]),
            self.event("response.output_item.done", output_index=0, item=item),
        ]

    def thinking_events(self, job: Job, d: EngineCoreOutput) -> list[JSONObject]:
        """The reasoning item as the thinking comes, closed when the answer starts."""
        events: list[JSONObject] = []
        if d.new_reasoning_text:
            if self.thinking == "no":
                events += self.open_thinking()
                self.thinking = "open"
            where = {"item_id": self.reasoning_id, "output_index": 0, "content_index": 0}
            events.append(self.event("response.reasoning_text.delta", **where, delta=d.new_reasoning_text))
        if self.thinking == "open" and (d.new_text or d.finished):
            events += self.close_thinking(job.outputs[0].outputs[0].reasoning_text)
            self.thinking = "closed"
        return events

    def events(self, job: Job, prompt_index: int, d: EngineCoreOutput) -> list[JSONObject]:
        events = [] if self.started else self.opening(job)
        self.started = True
        events += self.thinking_events(job, d)
        at = 0 if self.thinking == "no" else 1  # the message follows the reasoning item
        active = self.plan.active or self.thinking == "open"  # a thinking token's logprobs open no message
        if not active and not self.streaming_text and (d.new_text or d.new_logprobs or d.finished):
            events += self.open_message(at, self.message_id)
            self.streaming_text = True
        if not active and (d.new_text or d.new_logprobs):  # logprobs go with the text they score
            logprobs = token_logprobs(self.version, d.new_logprobs)
            events.append(self.text_delta(at, self.message_id, d.new_text, logprobs))
        if not d.finished:
            return events
        response = self.finished(job, job.outputs[0].outputs[0])
        for index, item in enumerate(response["output"]):
            if item["type"] == "reasoning":  # streamed as it came
                continue
            if item["type"] != "message":
                events += self.call_events(index, item)
                continue
            if not self.streaming_text:
                events += self.open_message(index, item["id"])
                part = item["content"][0]
                if part["text"]:
                    events.append(self.text_delta(index, item["id"], part["text"], part["logprobs"]))
            events += self.close_message(index, item)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return [*events, self.event(kind, response=response)]


def response_id(job: Job) -> str:
    return f"resp_{job.request_id}"  # the server's id (generate() sets it), never the client's X-Request-Id

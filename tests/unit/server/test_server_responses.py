"""POST /v1/responses (OpenAI's Responses API) over a real server process
running the fake engine core, through the official openai client; the
translation into chat, on its own."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_fakes import OFFSET

from stoker.server.responses_api import ResponsesRequest, as_chat_request, input_messages
from stoker.server.responses_store import ResponseStore, StoredResponse, output_messages

pytestmark = pytest.mark.timeout(120)
STOP_AT_D = OFFSET + ord("d")  # the fake engine writes a, b, c, d ...
TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


@pytest.fixture(scope="module")
def client(fake_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fake_server.url}/v1", api_key="x", max_retries=0)


def test_text_response_with_usage_and_settings(client: openai.OpenAI) -> None:
    r = client.responses.create(model="fake-model", input="hi", instructions="be brief", max_output_tokens=5)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "fake-model"
    assert r.output_text == "abcde"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    # instructions become a system message before the input
    assert r.usage.input_tokens == len("<system>be brief\n<user>hi\n<assistant>")
    assert r.usage.output_tokens == 5 and r.usage.total_tokens == r.usage.input_tokens + 5
    assert r.instructions == "be brief" and r.max_output_tokens == 5 and r.store is True
    done = client.responses.create(model="fake-model", input="hi", extra_body={"stop_token_ids": [STOP_AT_D]})
    assert done.status == "completed" and done.incomplete_details is None and done.output_text == "abc"


def test_stream_events_add_up_to_the_response(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model="fake-model", input="hi", max_output_tokens=4, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == "abcd" and final.usage.output_tokens == 4
    assert {e.item_id for e in events if e.type == "response.output_text.delta"} == {final.output[0].id}
    # the SDK's stream helper accumulates the same events into the final response
    with client.responses.stream(model="fake-model", input="hi", extra_body={"stop_token_ids": [STOP_AT_D]}) as stream:
        for _ in stream:
            pass
        assert stream.get_final_response().output_text == "abc"


def test_raw_stream_names_each_event(fake_server) -> None:
    body = {"model": "fake-model", "input": "hi", "max_output_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{fake_server.url}/v1/responses", json=body, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[0] == "event: response.created" and lines[-2] == "event: response.incomplete"
    assert "[DONE]" not in lines[-1]  # OpenAI ends a response stream with its last event


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"previous_response_id": "resp_1"}, "Previous response with id 'resp_1' not found"),
        ({"background": True}, "background is not supported"),
        ({"n": 2}, "one output per response"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": []}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"truncation": "auto"}, "truncation"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "needs a schema"),
        ({"text": {"format": {"type": "json_object"}}, "response_format": {"type": "json_object"}}, "not both"),
        ({"max_output_tokens": 10_000}, "maximum context length"),
        ({"include": ["reasoning.encrypted_content"]}, "include.0"),
        ({"top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_bad_requests_are_400(fake_server, extra: dict, fragment: str) -> None:
    r = httpx.post(f"{fake_server.url}/v1/responses", json={"model": "fake-model", "input": "hi", **extra}, timeout=30)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"], r.text


def test_conversation_items_become_chat_messages() -> None:
    body = ResponsesRequest.model_validate(
        {
            "instructions": "be brief",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Rome"}'},
                {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {"type": "message", "role": "assistant", "content": "It is sunny."},
            ],
        }
    )
    messages = input_messages(body)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[0]["content"] == [{"type": "text", "text": "weather?"}]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]  # parallel calls: one turn
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    earlier = [{"role": "user", "content": "before"}, {"role": "assistant", "content": "ok"}]
    chat = as_chat_request(body, earlier)  # instructions, then the earlier turns, then this input
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "user", "assistant", "tool", "assistant"]


def test_tools_and_text_format_take_chats_shapes() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = ResponsesRequest.model_validate(
        {
            "input": "hi",
            "tools": [TOOL],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "parallel_tool_calls": False,
            "text": {"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}},
            "max_output_tokens": 7,
            "temperature": 0.5,
            "top_k": 3,
        }
    )
    chat = as_chat_request(body)
    assert chat.tools is not None and chat.tools[0].function.name == "get_weather"
    assert chat.tool_choice is not None and chat.tool_choice.function.name == "get_weather"  # type: ignore[union-attr]
    assert chat.parallel_tool_calls is False and chat.max_tokens == 7
    assert chat.temperature == 0.5 and chat.top_k == 3  # vLLM's sampling extras pass through
    assert chat.response_format is not None and chat.response_format.json_schema is not None
    assert chat.response_format.json_schema.schema_ == schema


def test_stored_responses_continue_and_can_be_fetched_and_deleted(client: openai.OpenAI) -> None:
    first = client.responses.create(model="fake-model", input="hi", instructions="be brief", max_output_tokens=5)
    assert first.store is True
    assert client.responses.retrieve(first.id).output_text == "abcde"
    second = client.responses.create(
        model="fake-model", input="more", previous_response_id=first.id, max_output_tokens=3
    )
    # the earlier turn comes first; the earlier instructions are not carried over (as OpenAI)
    assert second.usage.input_tokens == len("<user>hi\n<assistant>abcde\n<user>more\n<assistant>")
    assert second.previous_response_id == first.id
    third = client.responses.create(
        model="fake-model", input="again", previous_response_id=second.id, max_output_tokens=1
    )
    assert third.usage.input_tokens == len(
        "<user>hi\n<assistant>abcde\n<user>more\n<assistant>abc\n<user>again\n<assistant>"
    )
    streamed = list(client.responses.create(model="fake-model", input="hi", max_output_tokens=2, stream=True))
    assert client.responses.retrieve(streamed[-1].response.id).output_text == "ab"
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(model="fake-model", input="x", previous_response_id=first.id)
    unstored = client.responses.create(model="fake-model", input="hi", max_output_tokens=1, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_store_keeps_the_newest_and_each_keys_own() -> None:
    def entry(n: int, owner: str | None) -> StoredResponse:
        return StoredResponse({"id": f"resp_{n}"}, [], owner)

    store = ResponseStore(2)
    for n in range(3):
        store.put(entry(n, "key-a"))
    assert store.get("resp_0", "key-a") is None and len(store) == 2  # the oldest went
    assert store.get("resp_1", "key-a") is not None
    assert store.get("resp_1", "key-b") is None and store.get("resp_1", None) is None
    assert not store.delete("resp_1", "key-b") and store.delete("resp_1", "key-a")
    store.put(entry(3, "key-a"))  # resp_1 was used last, but it is gone: resp_2 and resp_3 remain
    assert {n for n in range(4) if store.get(f"resp_{n}", "key-a")} == {2, 3}
    off = ResponseStore(0)
    off.put(entry(0, None))
    assert not off.enabled and len(off) == 0


def test_store_bounds_evict_by_owner_first() -> None:
    def entry(n: int, owner: str | None, text: str = "") -> StoredResponse:
        return StoredResponse({"id": f"resp_{n}"}, [{"role": "user", "content": text}], owner)

    # The same id under two owners: two entries, neither overwrites the other.
    store = ResponseStore(capacity=4, per_key=3, max_entry_bytes=1024)
    assert store.put(entry(0, "a", "mine")) and store.put(entry(0, "b", "theirs"))
    assert store.get("resp_0", "a").conversation[0]["content"] == "mine"
    assert store.delete("resp_0", "b") and store.get("resp_0", "a") is not None
    # Over its own bound, a key loses its own oldest.
    for n in range(1, 5):
        store.put(entry(n, "b"))
    assert store.held_by("b") == 3 and store.get("resp_1", "b") is None and store.held_by("a") == 1
    # The whole store full: the key holding the most gives one up, not the one holding least.
    assert len(store) == 4 and store.put(entry(5, "a"))
    assert store.held_by("a") == 2 and store.held_by("b") == 2 and store.get("resp_2", "b") is None
    # An entry over max_entry_bytes is not kept, and evicts nothing.
    assert not store.put(entry(6, "a", "x" * 1024)) and len(store) == 4 and store.get("resp_6", "a") is None


def test_output_items_become_the_assistant_turn() -> None:
    call = {
        "type": "function_call",
        "id": "fc_1",
        "call_id": "c1",
        "name": "f",
        "arguments": "{}",
        "status": "completed",
    }
    text = {"type": "message", "id": "msg_1", "content": [{"type": "output_text", "text": "Sure."}]}
    assert output_messages([text]) == [{"role": "assistant", "content": "Sure."}]
    (turn,) = output_messages([call])
    assert turn["content"] is None and turn["tool_calls"][0]["id"] == "c1"


def test_logprobs_when_included(client: openai.OpenAI) -> None:
    asked = {"include": ["message.output_text.logprobs"], "top_logprobs": 2, "max_output_tokens": 3}
    r = client.responses.create(model="fake-model", input="hi", **asked)
    scored = r.output[0].content[0].logprobs
    assert [s.token for s in scored] == ["a", "b", "c"]
    assert all(s.logprob <= 0 and len(s.top_logprobs) == 2 for s in scored)
    assert (
        client.responses.create(model="fake-model", input="hi", max_output_tokens=3).output[0].content[0].logprobs == []
    )
    events = list(client.responses.create(model="fake-model", input="hi", stream=True, **asked))
    streamed = [s.token for e in events if e.type == "response.output_text.delta" for s in e.logprobs]
    assert streamed == ["a", "b", "c"]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [s.token for s in done.logprobs] == ["a", "b", "c"]

"""POST /v1/messages (Anthropic's Messages API) over a real server process
running the fake engine core; the translation into chat on its own."""

from __future__ import annotations

import json

import httpx
import pytest

from stoker.server.anthropic_api import MessagesRequest, as_chat_request, stop_reason, tool_use_block

pytestmark = pytest.mark.timeout(120)
HEADERS = {"anthropic-version": "2023-06-01", "x-api-key": "unused"}
ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http(fake_server) -> httpx.Client:
    with httpx.Client(base_url=fake_server.url, timeout=30, headers=HEADERS) as client:
        yield client


def test_message_with_usage(http: httpx.Client) -> None:
    body = {"model": "fake-model", "max_tokens": 5, "system": "be brief", "messages": ASK}
    m = http.post("/v1/messages", json=body).json()
    assert m["type"] == "message" and m["role"] == "assistant" and m["id"].startswith("msg_")
    assert m["content"] == [{"type": "text", "text": "abcde"}]
    assert m["stop_reason"] == "max_tokens" and m["stop_sequence"] is None
    # the system prompt comes first, as a system message through the template
    assert m["usage"]["input_tokens"] == len("<system>be brief\n<user>hi\n<assistant>")
    assert m["usage"]["output_tokens"] == 5
    count = http.post("/v1/messages/count_tokens", json={"system": "be brief", "messages": ASK}).json()
    assert count == {"input_tokens": m["usage"]["input_tokens"]}


def test_stream_events(http: httpx.Client) -> None:
    body = {"model": "fake-model", "max_tokens": 4, "messages": ASK, "stream": True}
    with http.stream("POST", "/v1/messages", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    events = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names == [e["type"] for e in events]  # each event named on its own line too
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == "abcd" and events[-2]["delta"]["stop_reason"] == "max_tokens"
    assert events[-2]["usage"]["output_tokens"] == 4 and events[0]["message"]["usage"]["output_tokens"] == 0


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"messages": ASK}, "max_tokens"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "type"),
        ({"max_tokens": 5, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking"),
        ({"max_tokens": 5, "messages": ASK, "tool_choice": {"type": "tool"}}, "needs a name"),
        (
            {
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
            },
            "assistant turns",
        ),
        ({"max_tokens": 10_000, "messages": ASK}, "maximum context length"),
    ],
)
def test_bad_requests_are_400(http: httpx.Client, body: dict, fragment: str) -> None:
    r = http.post("/v1/messages", json={"model": "fake-model", **body})
    assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text


def test_tool_turns_become_chat_messages() -> None:
    body = MessagesRequest.model_validate(
        {
            "max_tokens": 9,
            "system": [{"type": "text", "text": "be brief"}],
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Let me look."},
                        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Rome"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "sunny"}]},
                        {"type": "text", "text": "and tomorrow?"},
                    ],
                },
            ],
            "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "stop_sequences": ["END"],
            "temperature": 0.5,
        }
    )
    chat = as_chat_request(body)
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assistant = chat.messages[2].model_dump()
    assert (
        assistant["content"] == "Let me look."
        and assistant["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"}'
    )
    assert chat.messages[3].model_dump()["tool_call_id"] == "t1" and chat.messages[3].content == "sunny"
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools is not None and chat.tools[0].function.parameters == {"type": "object"}
    assert chat.stop == ["END"] and chat.max_tokens == 9 and chat.temperature == 0.5


def test_stop_reasons_and_tool_use_blocks() -> None:
    assert stop_reason("stop", "END", False) == ("stop_sequence", "END")
    assert stop_reason("stop", 2, False) == ("end_turn", None)  # the eos token
    assert stop_reason("length", None, False) == ("max_tokens", None)
    assert stop_reason("stop", None, True) == ("tool_use", None)
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert tool_use_block(call) == {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}}


def test_output_config_format_is_a_json_schema_response_format(http: httpx.Client) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {"max_tokens": 5, "messages": ASK, "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    chat = as_chat_request(
        MessagesRequest.model_validate({**body, "output_config": {**body["output_config"], "effort": "low"}})
    )
    assert chat.response_format is not None and chat.response_format.json_schema is not None
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema_ == schema
    wrong = {**body, "output_config": {"format": {"type": "regex", "schema": schema}}}
    r = http.post("/v1/messages", json={"model": "fake-model", **wrong})
    assert r.status_code == 400 and "output_config" in r.json()["error"]["message"], r.text

"""The official anthropic client against a real `stoker serve` on the default
model: /v1/messages as a user of Anthropic's SDK reaches it."""

from __future__ import annotations

from typing import Literal

import anthropic
import pytest
from conftest import ServerProcess
from pydantic import BaseModel

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
MODEL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "Name three colors."}]
GREEDY = {"temperature": 0}  # anthropic 2.x takes sampling fields only in extra_body
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def client(real_server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=real_server.url, api_key="unused", max_retries=0, timeout=300)


def test_create_and_stream_agree(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model=MODEL, max_tokens=12, messages=ASK, extra_body=GREEDY)
    assert message.role == "assistant" and message.model == MODEL
    assert message.stop_reason in ("end_turn", "max_tokens") and 0 < message.usage.output_tokens <= 12
    text = message.content[0].text
    assert message.content[0].type == "text" and text

    with client.messages.stream(model=MODEL, max_tokens=12, messages=ASK, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.content[0].text == text
    assert final.usage.output_tokens == message.usage.output_tokens and final.stop_reason == message.stop_reason

    counted = client.messages.count_tokens(model=MODEL, messages=ASK)
    assert counted.input_tokens == message.usage.input_tokens


def test_stop_sequence_and_system(client: anthropic.Anthropic) -> None:
    free = client.messages.create(model=MODEL, max_tokens=16, messages=ASK, system="Answer briefly.", extra_body=GREEDY)
    words = free.content[0].text.split()
    assert len(words) >= 2, free.content
    cut = client.messages.create(
        model=MODEL, max_tokens=16, messages=ASK, system="Answer briefly.", extra_body=GREEDY, stop_sequences=[words[1]]
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == words[1]
    assert words[1] not in cut.content[0].text


def test_forced_tool_call_round_trip(client: anthropic.Anthropic) -> None:
    """A forced tool gives a tool_use block whose input fits the schema; its
    result goes back as a tool_result turn and the model answers in text."""
    ask = [{"role": "user", "content": "What is the weather in Rome?"}]
    message = client.messages.create(
        model=MODEL,
        max_tokens=200,
        messages=ask,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    )
    assert message.stop_reason == "tool_use"
    call = next(block for block in message.content if block.type == "tool_use")
    assert call.name == "get_weather" and isinstance(call.input["city"], str)

    result = {"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 24 C"}
    follow = [*ask, {"role": "assistant", "content": message.content}, {"role": "user", "content": [result]}]
    answer = client.messages.create(model=MODEL, max_tokens=16, messages=follow, tools=[WEATHER], extra_body=GREEDY)
    assert answer.content and answer.content[0].type in ("text", "tool_use")


class Colour(BaseModel):  # bounded fields: a tiny model's free strings may run on to max_tokens
    colour: Literal["red", "green", "blue"]
    warm: bool


def test_parse_gives_output_that_fits_the_model(client: anthropic.Anthropic) -> None:
    """messages.parse sends output_config.format; the reply is JSON of that schema."""
    parsed = client.messages.parse(model=MODEL, max_tokens=200, messages=ASK, output_format=Colour, extra_body=GREEDY)
    assert parsed.stop_reason == "end_turn", parsed.content
    assert isinstance(parsed.parsed_output, Colour)


def test_client_errors_are_the_sdks_exceptions(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError, match="maximum context length"):
        client.messages.create(model=MODEL, max_tokens=100_000, messages=ASK)
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        client.messages.create(
            model=MODEL, max_tokens=8, messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024}
        )
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=8, messages=ASK)

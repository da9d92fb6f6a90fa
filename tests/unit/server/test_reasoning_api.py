"""Thinking models on the APIs (issue 37): tiny random-weight Qwen3s with the
real Qwen3 and DeepSeek-R1-distill chat templates and <think>/</think> as added
tokens, served by a real `stoker serve` and read with the official openai and
anthropic clients. The thinking is produced deterministically: the R1 template
opens it, a Qwen3 reply prefilled with "<think>" continues inside it, and a
budget makes the engine write the end marker at a known token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest
from conftest import REPO, ServerProcess, start_server
from tiny_models import make_thinking_model, make_tiny_hf_model

from stoker.models.loader import load_tokenizer
from stoker.server.reasoning import (
    PromptThinking,
    ReasoningMarkers,
    parse_parser_choices,
    prompt_thinking,
    reasoning_params,
    request_budget,
    resolve_markers,
)

pytestmark = pytest.mark.timeout(600)
ASK = [{"role": "user", "content": "Why is the sky blue?"}]
GREEDY = {"temperature": 0}
DEFAULT_BUDGET = 6  # the server's --reasoning-budget
END = "</think>"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("thinking-models")
    return {
        "qwen": make_thinking_model("qwen3", tmp),
        "r1": make_thinking_model("deepseek_r1", tmp),
        "plain": make_tiny_hf_model("qwen3", tmp / "plain"),
    }


# ---- the parsers and the prompt, without a server ----------------------------


def test_parser_choices() -> None:
    choices = parse_parser_choices(["none", "r1=deepseek_r1"])
    assert choices.for_model("r1") == "deepseek_r1" and choices.for_model("other") == "none"
    assert parse_parser_choices([]).for_model("any") == "auto"
    for bad in (["qwen4"], ["=qwen3"], ["r1=bogus"]):
        with pytest.raises(ValueError, match=r"parser|name"):
            parse_parser_choices(bad)


def test_markers_from_templates(folders: dict[str, Path]) -> None:
    qwen, r1, plain = (load_tokenizer(str(folders[k])) for k in ("qwen", "r1", "plain"))
    assert resolve_markers("auto", qwen, "qwen") == ReasoningMarkers("qwen3", (49152,), (49153,))
    assert resolve_markers("auto", r1, "r1") == ReasoningMarkers("deepseek_r1", (49152,), (49153,))
    assert resolve_markers("auto", plain, "plain") is None  # ChatML without markers: does not think
    assert resolve_markers("none", qwen, "qwen") is None
    with pytest.raises(
        ValueError, match=r"model plain: --reasoning-parser qwen3 does not fit it: <think> and </think>"
    ):
        resolve_markers("qwen3", plain, "plain")


def test_what_the_prompt_did_about_the_thinking(folders: dict[str, Path]) -> None:
    qwen, r1 = load_tokenizer(str(folders["qwen"])), load_tokenizer(str(folders["r1"]))
    markers = ReasoningMarkers("qwen3", (49152,), (49153,))

    def state(tokenizer: object, messages: list[dict], continued: bool = False, **kwargs: object) -> PromptThinking:
        ids = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            messages, add_generation_prompt=not continued, continue_final_message=continued, tokenize=True, **kwargs
        )
        return prompt_thinking(markers, ids, tokenizer.decode, continued)  # type: ignore[attr-defined]

    assert state(qwen, ASK) is PromptThinking.UNSAID  # Qwen3 lets the model open it
    assert state(qwen, ASK, enable_thinking=False) is PromptThinking.CLOSED  # "<think>\n\n</think>\n\n"
    assert state(r1, ASK) is PromptThinking.OPEN  # the R1 template writes "<think>\n"
    # A marker in the user's words is not this reply's; an earlier turn's closed thinking neither.
    assert state(qwen, [{"role": "user", "content": "what does <think> mean?"}]) is PromptThinking.UNSAID
    history = [*ASK, {"role": "assistant", "content": "Blue.", "reasoning_content": "Rayleigh."}, *ASK]
    assert state(qwen, history) is PromptThinking.UNSAID
    prefilled = [*ASK, {"role": "assistant", "content": "<think>\nLight"}]
    assert state(qwen, prefilled, continued=True) is PromptThinking.OPEN

    assert reasoning_params(markers, PromptThinking.CLOSED, None) is None
    assert reasoning_params(markers, PromptThinking.UNSAID, 5).thinking_open is False  # type: ignore[union-attr]
    r1_markers = ReasoningMarkers("deepseek_r1", (49152,), (49153,))
    assert reasoning_params(r1_markers, PromptThinking.UNSAID, None).thinking_open is True  # type: ignore[union-attr]
    assert request_budget("low", None, 7) == 512 and request_budget("low", 3, 7) == 3
    assert request_budget(None, None, 7) == 7 and request_budget("none", None, None) == 0


def test_settings() -> None:
    from stoker.server.config import ServerConfig, env_values
    from stoker.server.reasoning import reasoning_fields

    config = ServerConfig.model_validate(env_values(ServerConfig, {"STOKER_REASONING_PARSER": "none r1=deepseek_r1"}))
    assert parse_parser_choices(config.reasoning_parser).for_model("r1") == "deepseek_r1"
    with pytest.raises(ValueError, match="qwen4"):
        ServerConfig(reasoning_parser=["qwen4"])
    with pytest.raises(ValueError, match="reasoning_budget"):
        ServerConfig(reasoning_budget=-1)
    assert reasoning_fields("t", "both") == {"reasoning_content": "t", "reasoning": "t"}
    assert reasoning_fields("t", "reasoning") == {"reasoning": "t"}


# ---- a real server ---------------------------------------------------------------


@pytest.fixture(scope="module")
def server(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = [
        *("--model", f"qwen={folders['qwen']}", "--model", f"r1={folders['r1']}"),
        *("--reasoning-parser", "r1=deepseek_r1", "--reasoning-budget", str(DEFAULT_BUDGET)),
        *("--no-embedding-model", "--max-model-len", "512", "--max-num-seqs", "8"),
    ]
    process = start_server(args, str(tmp_path_factory.mktemp("thinking-server")), ready_timeout=300)
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def extra(obj: object, name: str) -> object:
    """A field the openai SDK does not declare (reasoning_content, reasoning)."""
    return (getattr(obj, "model_extra", None) or {}).get(name)


def test_chat_keeps_thinking_apart_and_the_budget_ends_it(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="r1",
        messages=ASK,
        max_tokens=16,
        logprobs=True,
        extra_body=GREEDY,  # type: ignore[arg-type]
    )
    message = reply.choices[0].message
    thinking = extra(message, "reasoning_content")
    assert isinstance(thinking, str) and thinking and extra(message, "reasoning") == thinking
    tokens = [entry.token for entry in reply.choices[0].logprobs.content]  # type: ignore[union-attr]
    # The R1 template opened the thinking; the server's budget (6) ends it with the engine's own marker.
    assert tokens[DEFAULT_BUDGET] == END and END not in tokens[:DEFAULT_BUDGET]
    assert "".join(tokens[:DEFAULT_BUDGET]) == thinking
    assert "".join(tokens[DEFAULT_BUDGET + 1 :]) == message.content and END not in (message.content or "")
    usage = reply.usage
    assert usage is not None and usage.completion_tokens == 16
    assert usage.completion_tokens_details.reasoning_tokens == DEFAULT_BUDGET + 1  # type: ignore[union-attr]

    chunks = list(
        client.chat.completions.create(
            model="r1",
            messages=ASK,
            max_tokens=16,
            stream=True,
            extra_body=GREEDY,  # type: ignore[arg-type]
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(str(extra(d, "reasoning_content") or "") for d in deltas) == thinking
    assert "".join(str(extra(d, "reasoning") or "") for d in deltas) == thinking
    assert "".join(d.content or "" for d in deltas) == message.content
    assert all(not (extra(d, "reasoning_content") and d.content) for d in deltas)  # never in one delta's content


def test_budgets_and_switches(client: openai.OpenAI) -> None:
    def ask(model: str, messages: list[dict] = ASK, **fields: object) -> openai.types.chat.ChatCompletion:
        body = {**GREEDY, **fields}
        return client.chat.completions.create(
            model=model, messages=messages, max_tokens=12, logprobs=True, extra_body=body
        )  # type: ignore[arg-type]

    def tokens(reply: openai.types.chat.ChatCompletion) -> list[str]:
        return [entry.token for entry in reply.choices[0].logprobs.content]  # type: ignore[union-attr]

    assert tokens(ask("r1", reasoning_budget=3)).index(END) == 3
    assert tokens(ask("r1", reasoning_effort="none"))[0] == END  # budget 0: the marker comes first
    off = ask("r1", reasoning_effort="none")
    assert extra(off.choices[0].message, "reasoning_content") is None
    assert off.usage.completion_tokens_details.reasoning_tokens == 1  # type: ignore[union-attr]

    # Qwen3's own switch: the template closes the thinking, the reply is all answer.
    plain = ask("qwen", chat_template_kwargs={"enable_thinking": False})
    assert "reasoning_content" not in (plain.choices[0].message.model_extra or {})
    assert plain.usage.completion_tokens_details is None  # type: ignore[union-attr]
    # A Qwen3 reply prefilled with "<think>" continues inside the thinking, up to its budget.
    prefilled = [*ASK, {"role": "assistant", "content": "<think>\n"}]
    inside = ask("qwen", prefilled, reasoning_budget=4, add_generation_prompt=False, continue_final_message=True)
    assert tokens(inside).index(END) == 4
    assert extra(inside.choices[0].message, "reasoning_content") == "".join(tokens(inside)[:4])


def test_schema_and_tool_call_after_thinking(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "blue"]}, "n": {"type": "integer"}},
        "required": ["color", "n"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    for seed in range(3):
        reply = client.chat.completions.create(
            model="r1",
            messages=ASK,
            max_tokens=60,
            response_format=response_format,
            seed=seed,  # type: ignore[arg-type]
        )
        message = reply.choices[0].message
        assert extra(message, "reasoning_content")  # unconstrained thinking came first
        jsonschema.validate(json.loads(message.content or ""), schema)

    # Qwen3's own way: the model writes <think> first (forced here by logit_bias, which the answer's
    # grammar then overrules); the budget of 3 ends the thinking with the engine's marker.
    color = {k: v for k, v in schema.items() if k != "required"} | {"properties": {"color": {"enum": ["red", "blue"]}}}
    opened = client.chat.completions.create(
        model="qwen",
        messages=ASK,
        max_tokens=40,
        logprobs=True,
        response_format={"type": "json_schema", "json_schema": {"name": "color", "schema": color}},  # type: ignore[arg-type]
        logit_bias={"49152": 100},
        extra_body={**GREEDY, "reasoning_budget": 3},
    )
    tokens = [entry.token for entry in opened.choices[0].logprobs.content]  # type: ignore[union-attr]
    assert tokens[:5] == ["<think>"] * 4 + [END]
    assert extra(opened.choices[0].message, "reasoning_content") == "<think>" * 3  # the opening marker left out
    assert opened.usage.completion_tokens_details.reasoning_tokens == 5  # type: ignore[union-attr]
    assert opened.choices[0].finish_reason == "stop", opened.choices[0].message.content  # the grammar completed
    jsonschema.validate(json.loads(opened.choices[0].message.content or ""), color)

    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Rome", "Oslo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    reply = client.chat.completions.create(
        model="r1",
        messages=ASK,
        max_tokens=60,
        tools=[weather],
        tool_choice="required",
        parallel_tool_calls=False,
        extra_body=GREEDY,  # type: ignore[list-item,arg-type]
    )
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and extra(message, "reasoning_content")
    call = message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Rome", "Oslo")  # type: ignore[union-attr]

    # Streamed with a named function: the thinking first, then the call opens and its arguments follow.
    named = {"type": "function", "function": {"name": "get_weather"}}
    chunks = client.chat.completions.create(
        model="r1",
        messages=ASK,
        max_tokens=60,
        tools=[weather],
        tool_choice=named,
        stream=True,
        extra_body=GREEDY,  # type: ignore[list-item,arg-type]
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thinking_at = [i for i, d in enumerate(deltas) if extra(d, "reasoning_content")]
    calls_at = [i for i, d in enumerate(deltas) if d.tool_calls]
    assert thinking_at and calls_at and max(thinking_at) < min(calls_at)
    assert "".join(str(extra(deltas[i], "reasoning_content")) for i in thinking_at) == extra(
        message, "reasoning_content"
    )
    arguments = "".join(d.tool_calls[0].function.arguments or "" for d in deltas if d.tool_calls)  # type: ignore[index,union-attr]
    assert json.loads(arguments)["city"] in ("Rome", "Oslo")


def test_responses_reasoning_item(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model="r1", messages=ASK, max_tokens=16, extra_body=GREEDY)  # type: ignore[arg-type]
    thinking = extra(chat.choices[0].message, "reasoning_content")
    response = client.responses.create(model="r1", input=ASK[0]["content"], max_output_tokens=16, temperature=0)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"]
    reasoning = response.output[0]
    assert reasoning.content[0].type == "reasoning_text" and reasoning.content[0].text == thinking  # type: ignore[union-attr,index]
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.output_tokens_details.reasoning_tokens == DEFAULT_BUDGET + 1  # type: ignore[union-attr]

    events = list(
        client.responses.create(model="r1", input=ASK[0]["content"], max_output_tokens=16, temperature=0, stream=True)
    )
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    final = events[-1].response  # response.incomplete: max_output_tokens cut the answer, as in the reply above
    assert "".join(deltas) == thinking and [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == response.output_text

    off = client.responses.create(
        model="r1", input=ASK[0]["content"], max_output_tokens=8, temperature=0, reasoning={"effort": "none"}
    )
    assert [item.type for item in off.output] == ["message"]
    # The reasoning item goes back as input (as the SDK's users pass output on).
    again = client.responses.create(
        model="r1",
        input=[*ASK, *[i.model_dump() for i in response.output], *ASK],
        max_output_tokens=4,  # type: ignore[list-item]
    )
    assert again.status in ("completed", "incomplete")
    # Continued by id: the stored turn keeps its thinking as reasoning_content (R1's template drops it, rendering succeeds).
    follow = client.responses.create(
        model="r1", input="And at sunset?", previous_response_id=response.id, max_output_tokens=4
    )
    assert follow.previous_response_id == response.id and follow.output


def test_messages_thinking_blocks(claude: anthropic.Anthropic, client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="r1",
        messages=ASK,
        max_tokens=16,
        extra_body={**GREEDY, "reasoning_budget": 5},  # type: ignore[arg-type]
    )
    enabled = {"type": "enabled", "budget_tokens": 5}
    message = claude.messages.create(model="r1", max_tokens=16, messages=ASK, thinking=enabled, extra_body=GREEDY)  # type: ignore[arg-type]
    assert [block.type for block in message.content] == ["thinking", "text"]
    block = message.content[0]
    assert block.thinking == extra(chat.choices[0].message, "reasoning_content") and block.signature  # type: ignore[union-attr]
    assert message.content[1].text == chat.choices[0].message.content  # type: ignore[union-attr]

    with claude.messages.stream(model="r1", max_tokens=16, messages=ASK, thinking=enabled, extra_body=GREEDY) as stream:  # type: ignore[arg-type]
        streamed = [e.thinking for e in stream if e.type == "thinking"]
        final = stream.get_final_message()
    assert "".join(streamed) == block.thinking  # type: ignore[union-attr]
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in message.content]

    off = claude.messages.create(
        model="r1", max_tokens=8, messages=ASK, thinking={"type": "disabled"}, extra_body=GREEDY
    )
    assert [b.type for b in off.content] == ["text"]
    # A thinking block sent back is the assistant turn's reasoning_content (Qwen3's template shows the latest one).
    turn = [*ASK, {"role": "assistant", "content": [block.model_dump(), {"type": "text", "text": "Blue."}]}]
    with_thinking = claude.messages.count_tokens(model="qwen", messages=turn)  # type: ignore[arg-type]
    without = claude.messages.count_tokens(model="qwen", messages=[*ASK, {"role": "assistant", "content": "Blue."}])
    assert with_thinking.input_tokens > without.input_tokens


def test_reasoning_on_input_messages(server: ServerProcess) -> None:
    def render(turn: dict) -> list[int]:
        body = {"model": "qwen", "messages": [*ASK, turn], "add_generation_prompt": False}
        response = httpx.post(f"{server.url}/v1/chat/completions/render", json=body, timeout=30)
        assert response.status_code == 200, response.text
        return response.json()["token_ids"]

    newer = render({"role": "assistant", "content": "Blue.", "reasoning": "Rayleigh scattering."})
    older = render({"role": "assistant", "content": "Blue.", "reasoning_content": "Rayleigh scattering."})
    bare = render({"role": "assistant", "content": "Blue."})
    assert newer == older and len(newer) > len(bare)


@pytest.mark.parametrize(
    ("path", "body", "words"),
    [
        ("/v1/chat/completions", {"reasoning_effort": "extreme"}, "reasoning_effort"),
        ("/v1/chat/completions", {"reasoning_budget": -1}, "reasoning_budget"),
        ("/v1/chat/completions", {"chat_template_kwargs": {"enable_thinking": "yes"}}, "enable_thinking"),
        (
            "/v1/chat/completions",
            {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
            "enable_thinking",
        ),
        ("/v1/responses", {"reasoning": {"effort": "huge"}}, "effort"),
        ("/v1/messages", {"thinking": {"type": "enabled"}}, "budget_tokens"),
        ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": 16}}, "less than max_tokens"),
        ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": 0}}, "budget_tokens"),
    ],
)
def test_bad_thinking_fields_are_400(server: ServerProcess, path: str, body: dict, words: str) -> None:
    base: dict[str, object] = {"model": "r1", "max_tokens": 16}
    base |= {"input": "hi"} if path == "/v1/responses" else {"messages": ASK}
    response = httpx.post(f"{server.url}{path}", json={**base, **body}, timeout=30)
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"]


def test_a_parser_that_does_not_fit_stops_the_start(folders: dict[str, Path], tmp_path: Path) -> None:
    def serve(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "stoker.cli", "serve", "--port", "0", "--no-embedding-model", *args]
        # Its own key database: a refused start must not open (or create) the user's ~/.stoker one.
        env = {**os.environ, "STOKER_DB": str(tmp_path / "stoker.db")}
        return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)

    misfit = serve(str(folders["plain"]), "--reasoning-parser", "qwen3", "--max-model-len", "256")
    assert misfit.returncode == 1
    lines = [line for line in misfit.stderr.splitlines() if "does not fit" in line]
    assert len(lines) == 1 and "--reasoning-parser qwen3" in lines[0] and "<think>" in lines[0], misfit.stderr
    unknown = serve(str(folders["plain"]), "--reasoning-parser", "nosuch=qwen3")
    assert unknown.returncode == 2 and "nosuch" in unknown.stderr

"""Structured output and tools at the HTTP edge: every bad constraint is a 400
naming the field (OpenAI's error shape) before anything reaches the engine;
the compile check bounds size and time; tool replies parse into tool_calls."""

from __future__ import annotations

import asyncio
import copy
import json

import httpx
import pytest
from tokenizers import AddedToken

from stoker.config import default_model_path
from stoker.engine.grammar_compiler import GrammarCompiler
from stoker.engine.grammars import json_schema_grammar
from stoker.errors import APIError
from stoker.models.loader import load_tokenizer
from stoker.models.tokenizer import Tokenizer
from stoker.server.protocol import ChatCompletionRequest
from stoker.server.structured import Constraint, GrammarChecker, requested_constraint
from stoker.server.tools import parse_reply, plan_tools, prepare_messages

pytestmark = pytest.mark.timeout(120)
CHAT = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def http(fake_server) -> httpx.Client:
    with httpx.Client(base_url=fake_server.url, timeout=30) as client:
        yield client


def _error(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"guided_regex": "a+", "guided_choice": ["x"]}, None, "only one output constraint"),
        ({"response_format": {"type": "json_object"}, "guided_json": {}}, None, "only one"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_json": [1, 2]}, None, "guided_json"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"response_format": {"type": "json_schema"}}, None, "needs a json_schema"),
        ({"response_format": {"type": "xml"}}, None, "response_format"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, None, "exactly one"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope'",
        ),
        ({"tool_choice": "required"}, "tool_choice", "at least one tool"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "distinct"),
        (
            {"messages": [*CHAT, {"role": "assistant", "tool_calls": [{"id": "x"}]}], "tools": [WEATHER]},
            "messages",
            "tool_calls must be",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, None, "name"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "cannot be combined",
        ),
    ],
)
def test_bad_constraints_are_400_naming_the_problem(
    http: httpx.Client, extra: dict, param: str | None, words: str
) -> None:
    error = _error(http.post("/v1/chat/completions", json={"messages": CHAT, **extra}))  # extra may replace messages
    assert words in error["message"]
    if param is not None:
        assert error["param"] == param


def test_completions_reject_bad_constraints_too(http: httpx.Client) -> None:
    error = _error(http.post("/v1/completions", json={"prompt": "x", "guided_choice": ["a"], "guided_regex": "b"}))
    assert "only one output constraint" in error["message"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def _check(checker: GrammarChecker, grammar: str, param: str = "guided_json") -> None:
    asyncio.run(checker.check(Constraint(grammar, param)))


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "strin"}, "strin"),
        ({"type": "string", "format": "weird"}, "weird"),
        ({"type": "string", "pattern": "(["}, "regex"),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
    ],
)
def test_compile_errors_name_the_problem(tokenizer, schema: dict, words: str) -> None:
    checker = GrammarChecker(tokenizer, max_bytes=1 << 20, timeout_s=30)
    with pytest.raises(APIError) as err:
        _check(checker, json_schema_grammar(schema))
    assert err.value.status == 400 and words in err.value.message and err.value.param == "guided_json"


def test_size_and_time_limits(tokenizer) -> None:
    big = json_schema_grammar({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(200)}})
    with pytest.raises(APIError, match="at most 1024"):
        _check(GrammarChecker(tokenizer, max_bytes=1024, timeout_s=30), big)
    slow = GrammarChecker(tokenizer, max_bytes=1 << 20, timeout_s=1e-4)
    with pytest.raises(APIError, match=r"longer than 0\.0001 s"):
        _check(slow, big)


def test_a_slow_compile_stalls_neither_the_event_loop_nor_other_requests(tokenizer) -> None:
    """A big schema compiles in a worker thread (llguidance drops the GIL): while
    it runs, the event loop keeps ticking and a small schema's check finishes
    first; past the timeout the big one is a 400 and the small one still passes."""
    big = json_schema_grammar(
        {
            "type": "object",
            "properties": {
                f"p{i}": {
                    "type": "object",
                    "properties": {"a": {"type": "string", "pattern": "[a-z]{3,9}@x"}, "b": {"enum": list("xyz")}},
                }
                for i in range(800)
            },
            "required": [f"p{i}" for i in range(800)],
        }
    )
    small = json_schema_grammar({"type": "object", "properties": {"n": {"type": "integer"}}})

    async def scenario(timeout_s: float) -> tuple[list[str], int]:
        checker = GrammarChecker(tokenizer, max_bytes=1 << 20, timeout_s=timeout_s)
        await checker.check(Constraint(json_schema_grammar({"type": "string"}), "guided_json"))  # wraps the tokenizer
        finished: list[str] = []
        ticks = 0

        async def check(name: str, grammar: str) -> None:
            try:
                await checker.check(Constraint(grammar, "guided_json"))
                finished.append(name)
            except APIError as exc:
                finished.append(f"{name}: {exc.status} {exc.message}")

        slow = asyncio.create_task(check("big", big))
        await asyncio.sleep(0)  # the big compile starts first
        fast = asyncio.create_task(check("small", small))
        while not slow.done():
            ticks += 1
            await asyncio.sleep(0.001)
        await fast
        return finished, ticks

    finished, ticks = asyncio.run(scenario(30.0))
    assert finished == ["small", "big"] and ticks >= 3, (finished, ticks)
    finished, _ = asyncio.run(scenario(0.05))  # the big one compiles in ~0.1 s, the small in ~1 ms
    assert "small" in finished and any(f.startswith("big: 400") and "longer than" in f for f in finished), finished


def _plan(tokenizer, **body):
    request = ChatCompletionRequest.model_validate({"messages": CHAT, **body})
    return plan_tools(request, None, tokenizer)


def test_tool_replies_parse_into_calls(tokenizer) -> None:
    named = _plan(tokenizer, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    content, calls = parse_reply('{"city": "Oslo"}', named)
    assert content is None and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    required = _plan(tokenizer, tools=[WEATHER], tool_choice="required")
    _, calls = parse_reply(
        '[{"name": "get_weather", "arguments": {"city": "A"}}, {"name": "get_weather", "arguments": {"city": "B"}}]',
        required,
    )
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["A", "B"]
    assert len({c["id"] for c in calls}) == 2
    auto = _plan(tokenizer, tools=[WEATHER])
    content, calls = parse_reply(
        'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "C"}}</tool_call>', auto
    )
    assert content == "Sure." and calls[0]["function"]["name"] == "get_weather"
    assert parse_reply('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', auto)[1] == []
    assert parse_reply('{"city": "cut by max_tok', named) == ('{"city": "cut by max_tok', [])
    assert parse_reply("plain", _plan(tokenizer))[1] == []


def test_history_with_calls_renders_for_a_template_without_tools(tokenizer) -> None:
    plan = _plan(tokenizer, tools=[WEATHER])
    history = [
        *CHAT,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    messages, kwargs = prepare_messages(history, plan, tokenizer.chat_template)
    text = tokenizer.apply_chat_template(messages, **kwargs)
    assert (
        '"name": "get_weather"' in text
        and '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text
    )
    assert "<|im_start|>tool\nsunny" in text
    assert (
        prepare_messages(history, _plan(tokenizer), tokenizer.chat_template)[0][0] == CHAT[0]
    )  # no tools: nothing added


def test_valid_constraints_pass_the_check_and_reach_the_engine(http: httpx.Client) -> None:
    """The fake engine ignores grammars (it always spells "abc..."): this is about the front end's path."""
    for extra in (
        {"guided_regex": "[a-z]+"},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
        {"structured_outputs": {"choice": ["a", "b"]}},
        {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},  # fits 256 tokens
    ):
        r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3, **extra})
        assert r.status_code == 200, r.text
    # Not JSON, so not a call: the text comes back as content with the engine's finish reason.
    message = r.json()["choices"][0]
    assert message["message"]["content"] == "abc" and message["finish_reason"] == "length"


def test_named_tool_streams_the_call_then_argument_fragments(fake_server) -> None:
    """OpenAI's shape: the call's id and name first, then its arguments in pieces;
    the openai client's delta accumulation rebuilds the whole call."""
    import openai

    client = openai.OpenAI(base_url=f"{fake_server.url}/v1", api_key="x", max_retries=0)
    tool = {"type": "function", "function": {"name": "f"}}
    stream = client.chat.completions.create(
        model="fake-model",
        messages=CHAT,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "f"}},
        max_tokens=3,
        stream=True,
    )
    chunks = [c for c in stream if c.choices]
    calls = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices[0].delta.tool_calls]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "f" and calls[0].function.arguments == ""
    assert [c.function.arguments for c in calls[1:]] == ["a", "b", "c"]  # the fake engine spells "abc"
    assert all(c.index == 0 and c.id is None for c in calls[1:])
    assert chunks[-1].choices[0].finish_reason == "length"  # cut by max_tokens, as the engine said


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "f"}}, "auto"])
def test_streamed_tool_replies_keep_their_logprobs(fake_server, tool_choice) -> None:
    """The same logprobs as the non-streamed reply: with the argument fragments
    of a named call, with the reply parsed at its end otherwise."""
    body = {"model": "fake-model", "messages": CHAT, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}
    body |= {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": tool_choice}
    whole = httpx.post(f"{fake_server.url}/v1/chat/completions", json=body).json()
    expected = [e["token"] for e in whole["choices"][0]["logprobs"]["content"]]
    with httpx.stream("POST", f"{fake_server.url}/v1/chat/completions", json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = [e for ev in events for c in ev["choices"] if c["logprobs"] for e in c["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == expected == ["a", "b", "c"]
    assert all(len(e["top_logprobs"]) == 2 for e in streamed)


def _qwen_like(tokenizer, template: str):
    """The default tokenizer with <tool_call> and </tool_call> as added tokens
    (as Qwen2.5 has them) and another added token (as Qwen3's <think>)."""
    hf = copy.deepcopy(tokenizer.hf)
    hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>", "<think>")])
    return Tokenizer(hf, tokenizer.eos_token_ids, chat_template=template)


def test_auto_constrains_calls_only_in_the_tool_call_convention(tokenizer) -> None:
    """Constrained where the model is asked for <tool_call> blocks: stoker's own
    note (a template without tools) or a template that renders them (Qwen,
    Hermes); not where a template has a call format of its own (Llama 3.1)."""
    plain = _plan(tokenizer, tools=[WEATHER])
    assert plain.constraint is not None and plain.constraint.param == "tools"
    assert "<tool_call>" in plain.constraint.grammar and "get_weather" in plain.constraint.grammar
    assert _plan(tokenizer, tools=[WEATHER], parallel_tool_calls=False).constraint.grammar != plain.constraint.grammar
    qwen = _qwen_like(
        tokenizer, "{% if tools %}<tools>{{ tools }}</tools> answer in <tool_call></tool_call>{% endif %}"
    )
    assert _plan(qwen, tools=[WEATHER]).constraint is not None
    llama31 = _qwen_like(tokenizer, '{% if tools %}Respond in the format {"name": ..., "parameters": ...}{% endif %}')
    assert _plan(llama31, tools=[WEATHER]).constraint is None
    body = {"messages": CHAT, "tools": [WEATHER], "response_format": {"type": "json_object"}}
    other = requested_constraint(ChatCompletionRequest.model_validate(body))
    assert (
        plan_tools(ChatCompletionRequest.model_validate(body), other, tokenizer).constraint is None
    )  # the format wins
    assert _plan(tokenizer, tools=[WEATHER], tool_choice="none").constraint is None


def test_auto_grammar_uses_the_tags_added_tokens(tokenizer) -> None:
    """Where <tool_call> is one added token, llguidance sees it as a special
    token, not as text: the grammar must open a call on that token, and let
    free text hold the tokenizer's other added tokens."""
    qwen = _qwen_like(tokenizer, "{% if tools %}<tool_call>{% endif %}")
    grammar = _plan(qwen, tools=[WEATHER]).constraint.grammar
    compiler = GrammarCompiler(qwen.hf, qwen.vocab_size, qwen.eos_token_ids)

    def accepts(text: str) -> bool:
        matcher = compiler.matcher(grammar)
        return all(matcher.consume_token(t) for t in qwen.encode(text, add_special_tokens=False))

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert qwen.encode("<tool_call>", add_special_tokens=False) == [qwen.hf.get_added_vocab()["<tool_call>"]]
    assert accepts(f"<think>hm</think> a < b {call} and {call}")
    assert not accepts('<tool_call>\n{"name": "get_time"')
    assert not accepts('<tool_call>\n{"name": "get_weather", "arguments": {"town": ')


def test_auto_with_a_bad_tool_schema_is_a_400_naming_it(http: httpx.Client) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}
    error = _error(http.post("/v1/chat/completions", json={"messages": CHAT, "tools": [tool]}))
    assert error["param"] == "tools" and error["message"] == "tools: Invalid type: strin"

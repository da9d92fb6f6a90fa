"""The HTTP API's shapes and status codes, over a real server process running
the fake engine core (seconds, no model)."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.timeout(120)
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http(fake_server) -> httpx.Client:
    with httpx.Client(base_url=fake_server.url, timeout=30) as client:
        yield client


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_chat_non_streaming(http: httpx.Client) -> None:
    body = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 5, "n": 2}).json()
    assert body["object"] == "chat.completion" and body["model"] == "fake-model"
    assert [c["message"]["content"] for c in body["choices"]] == ["abcde", "bcdef"]
    assert {c["finish_reason"] for c in body["choices"]} == {"length"}
    usage = body["usage"]
    assert usage["completion_tokens"] == 10 and usage["total_tokens"] == usage["prompt_tokens"] + 10
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


def test_max_completion_tokens_and_text_parts(http: httpx.Client) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    body = http.post("/v1/chat/completions", json={"messages": parts, "max_completion_tokens": 2, "max_tokens": 9})
    assert body.json()["choices"][0]["message"]["content"] == "ab"


def test_openai_client_streaming_with_usage(fake_server) -> None:
    client = openai.OpenAI(base_url=f"{fake_server.url}/v1", api_key="x", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model="fake-model", messages=CHAT, max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "abcd"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-2].choices[0].finish_reason == "length"


def test_chat_logprobs(http: httpx.Client) -> None:
    body = http.post(
        "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": 2}
    ).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["a", "b"] and content[0]["bytes"] == [97]
    assert len(content[0]["top_logprobs"]) == 2


def test_completions_forms(http: httpx.Client) -> None:
    for prompt in ("ab", ["ab", "cd"], [100, 101], [[100], [101, 102]]):
        body = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "n": 2}).json()
        count = 1 if isinstance(prompt, str) or isinstance(prompt[0], int) else 2
        assert [c["index"] for c in body["choices"]] == list(range(2 * count))
        assert body["choices"][0]["text"] == "ab" and body["object"] == "text_completion"


def test_completions_echo_logprobs_stream(http: httpx.Client) -> None:
    body = http.post("/v1/completions", json={"prompt": "xy", "max_tokens": 2, "echo": True}).json()
    assert body["choices"][0]["text"] == "xyab"
    body = http.post("/v1/completions", json={"prompt": "xy", "max_tokens": 3, "logprobs": 1}).json()
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["a", "b", "c"] and logprobs["text_offset"] == [0, 1, 2]
    with http.stream("POST", "/v1/completions", json={"prompt": "xy", "max_tokens": 3, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and len(lines) == 4


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "x", "suffix": "y"}, None),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "seed": 2**70}, "seed"),
        ({"prompt": "x", "best_of": 3}, None),
        ({"prompt": "x", "echo": True, "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt": "x", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"prompt": "x", "num_speculative_tokens": 17}, "num_speculative_tokens"),
        ({"prompt": "x", "num_speculative_tokens": -1}, "num_speculative_tokens"),
        # JSON booleans are not numbers, nor numbers and strings booleans (pydantic's lax mode took them)
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": "x", "temperature": False}, "temperature"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": "x", "logprobs": True}, "logprobs"),
        ({"prompt": "x", "stream": 1}, "stream"),
        ({"prompt": "x", "echo": "yes"}, "echo"),
        # ids beyond the vocabulary: refused here, whatever the engine would do
        ({"prompt": "x", "stop_token_ids": [10**6]}, "stop_token_ids"),
        ({"prompt": "x", "logit_bias": {"1000000": 1}}, "logit_bias"),
    ],
)
def test_completion_client_errors_are_400(http: httpx.Client, body: dict, param: str | None) -> None:
    error = error_of(http.post("/v1/completions", json=body), 400)
    if param is not None:
        assert error["param"].startswith(param), error


@pytest.mark.parametrize(
    "body",
    [
        {"messages": []},
        {"messages": [{"role": "robot", "content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {"messages": CHAT, "functions": [{"name": "f"}]},
        {"messages": CHAT, "top_logprobs": 2},
        {"messages": CHAT, "response_format": {"type": "xml"}},
        {"messages": [{"role": "user"}]},  # content may be absent only on an assistant turn
    ],
)
def test_chat_client_errors_are_400(http: httpx.Client, body: dict) -> None:
    error_of(http.post("/v1/chat/completions", json=body), 400)


def test_chat_template_fields(http: httpx.Client) -> None:
    answer = [*CHAT, {"role": "assistant", "content": "Hello"}]

    def rendered(body: dict) -> str:
        tokens = http.post("/tokenize", json=body).json()["tokens"]
        return http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]

    assert rendered({"messages": answer}).endswith("<assistant>Hello\n<assistant>")
    continued = {"messages": answer, "continue_final_message": True, "add_generation_prompt": False}
    assert rendered(continued).endswith("<assistant>Hello")
    assert rendered({"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}).startswith(
        "<vars enable_thinking=False>"
    )
    body = http.post("/v1/chat/completions", json={**continued, "max_tokens": 2}).json()
    assert body["usage"]["prompt_tokens"] == len("<user>hi\n<assistant>Hello")
    # both at once contradict each other (vLLM refuses it too); a template from the client is not run
    error = error_of(http.post("/v1/chat/completions", json={**continued, "add_generation_prompt": True}), 400)
    assert "continue_final_message" in error["message"]
    error = error_of(http.post("/tokenize", json={**continued, "add_generation_prompt": True}), 400)
    assert "continue_final_message" in error["message"]  # not the completion form's "prompt: Field required"
    for path in ("/v1/chat/completions", "/tokenize"):
        error = error_of(http.post(path, json={"messages": CHAT, "chat_template": "{{ 1 }}"}), 400)
        assert error["message"] == "chat_template is not supported by this server"
    error = error_of(http.post("/v1/chat/completions", json={"messages": CHAT, "chat_template_kwargs": [1]}), 400)
    assert error["param"] == "chat_template_kwargs"


def test_union_errors_name_the_branch_that_fit(http: httpx.Client) -> None:
    """A field that takes several shapes: the error from the shape the input had, without pydantic's tags."""
    cases = [
        ({"prompt": []}, "prompt", "at least 1 item"),
        ({"prompt": ["a", ""]}, "prompt.1", "at least 1 character"),
        ({"prompt": "x", "stop": [""]}, "stop.0", "at least 1 character"),
        ({"prompt": "x", "priority": 10**6}, "priority", "less than or equal to 100"),
    ]
    for body, param, fragment in cases:
        error = error_of(http.post("/v1/completions", json=body), 400)
        assert error["param"] == param and fragment in error["message"], error


def test_numbers_keep_their_json_types(http: httpx.Client) -> None:
    assert error_of(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2.0}), 400)["param"] == "max_tokens"
    body = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 1}).json()
    assert body["usage"]["completion_tokens"] == 2  # an integer is a number


def test_openapi_documents_every_answer(http: httpx.Client) -> None:
    schema = http.get("/openapi.json").json()
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    # constraints stay JSON Schema's minimum/maximum, not pydantic's ge/le
    assert '"ge"' not in str(schema).replace("'", '"') and '"le"' not in str(schema).replace("'", '"')
    stop_ids = schema["components"]["schemas"]["CompletionRequest"]["properties"]["stop_token_ids"]["anyOf"][0]
    assert stop_ids["items"]["minimum"] == 0
    error = schema["components"]["schemas"]["ErrorResponse"]
    assert error["properties"]["error"]["required"] == ["message", "type"]
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            codes = set(operation["responses"])
            assert "422" not in codes, (method, path)  # validation failures are 400s
            assert {"400", "401", "404", "429", "503"} <= codes, (method, path, codes)
    message = schema["components"]["schemas"]["ChatMessage"]
    assert message["else"]["required"] == ["content"]  # only an assistant turn may omit it


def test_405_names_every_method_of_the_path(http: httpx.Client) -> None:
    # GET, PATCH and DELETE /admin/keys/{id} are three routes: Starlette's 405 named only the first.
    answer = http.request("PUT", "/admin/keys/nope")
    error_of(answer, 405)
    assert set(answer.headers["allow"].split(", ")) == {"GET", "PATCH", "DELETE"}
    answer = http.request("PUT", "/v1/completions")
    assert answer.status_code == 405 and answer.headers["allow"] == "POST"


def test_malformed_json_and_wrong_types(http: httpx.Client) -> None:
    error = error_of(
        http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}), 400
    )
    assert "JSON" in error["message"]
    error_of(http.post("/v1/chat/completions", json=[1, 2]), 400)
    error_of(http.post("/v1/chat/completions", json={"messages": "hi"}), 400)


def test_context_overflow_names_the_numbers(http: httpx.Client) -> None:
    error = error_of(http.post("/v1/completions", json={"prompt": "x" * 200, "max_tokens": 100}), 400)
    assert "256" in error["message"] and "300" in error["message"] and "200" in error["message"]
    error_of(http.post("/v1/completions", json={"prompt": "x" * 300, "max_tokens": 1}), 400)


def test_unknown_model_404_and_route_404(http: httpx.Client) -> None:
    assert (
        error_of(http.post("/v1/completions", json={"prompt": "x", "model": "gpt-9"}), 404)["code"] == "model_not_found"
    )
    error_of(http.get("/v1/nothing"), 404)
    error_of(http.post("/v1/embeddings", json={"input": "x"}), 404)  # started with --no-embedding-model


def test_body_too_large_413(http: httpx.Client) -> None:
    error_of(http.post("/v1/completions", json={"prompt": "x" * 70_000}), 413)

    def chunks():
        for _ in range(100):
            yield b"x" * 1000

    error_of(http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413)


def test_models_tokenize_detokenize_version_health(http: httpx.Client, fake_server) -> None:
    models = http.get("/v1/models").json()["data"]
    assert models[0]["id"] == "fake-model" and models[0]["max_model_len"] == 256
    assert http.get("/v1/models/fake-model").json() == models[0]
    assert error_of(http.get("/v1/models/org/other"), 404)["code"] == "model_not_found"
    client = openai.OpenAI(base_url=f"{fake_server.url}/v1", api_key="x", max_retries=0)
    assert client.models.retrieve("fake-model").id == "fake-model"
    tokens = http.post("/tokenize", json={"prompt": "hi"}).json()
    assert tokens["tokens"] == [107, 108] and tokens["count"] == 2
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > 2
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "hi"}
    error_of(http.post("/detokenize", json={"tokens": [10**6]}), 400)
    error_of(http.post("/tokenize", json={}), 400)
    assert http.get("/version").json()["version"]
    assert http.get("/health").json() == {"status": "ok"}
    ready = http.get("/ready").json()
    assert ready["ready"] and ready["engine_pid"] and ready["engine_stats"]["kv_blocks_total"] == 64

"""Extreme sampling parameters with logprobs, streamed and not, on a live
server over a tiny random model (the real engine and sampler): every answer
is a 4xx naming the field, or strictly valid JSON with finite logprobs."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import ServerProcess, start_server
from tiny_models import make_tiny_hf_model

pytestmark = pytest.mark.timeout(600)

PROMPT = "the the the cat cat sat on the mat the the"

# In range: each must be served, with finite numbers everywhere.
IN_RANGE: list[dict[str, Any]] = [
    {"repetition_penalty": 5e-324},
    {"repetition_penalty": 100.0},
    {"repetition_penalty": 5e-324, "temperature": 2.0},
    {"repetition_penalty": 100.0, "temperature": 1e-300},
    {"temperature": 2.0, "top_p": 5e-324},
    {"top_k": 1, "min_p": 1.0},
    {"min_p": 5e-324, "top_k": -1},
    {"presence_penalty": 2.0, "frequency_penalty": 2.0, "min_tokens": 4},
    {"presence_penalty": -2.0, "frequency_penalty": -2.0},
    {"seed": -(2**63)},
    {"seed": 2**63 - 1024, "n": 3},  # the largest the schema states (exact as a JSON double)
    {"stop_token_ids": [0, 1, 2], "min_tokens": 8, "repetition_penalty": 5e-324},
    {"logit_bias": {"0": -100, "42": 100.0, "43": -100}, "repetition_penalty": 5e-324},
]
# Out of range: each must be a 400 naming the field.
OUT_OF_RANGE: list[tuple[dict[str, Any], str]] = [
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -1e-300}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.0000001}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 1e300}, "repetition_penalty"),
    ({"presence_penalty": 2.0000001}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"n": 0}, "n"),
    ({"seed": 2**63}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": ""}, "stop"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"priority": 101}, "priority"),
    ({"timeout": 0}, "timeout"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"999999999": 1}}, "logit_bias"),
]


def strict_loads(text: str) -> Any:
    """json.loads that refuses NaN and Infinity, as strict clients (and JSON itself) do."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def numbers(value: Any) -> Iterator[float]:
    if isinstance(value, float | int) and not isinstance(value, bool):
        yield float(value)
    elif isinstance(value, dict):
        for v in value.values():
            yield from numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from numbers(v)


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("edges")
    model = make_tiny_hf_model("llama", tmp)
    server = start_server(
        ["--model", str(model), "--dtype", "float32", "--no-embedding-model", "--max-model-len", "256"], str(tmp)
    )
    try:
        yield server
    finally:
        server.stop()


def body_for(endpoint: str, params: dict[str, Any], stream: bool) -> dict[str, Any]:
    common = {"max_tokens": 12, "stream": stream, **params}
    if endpoint == "/v1/completions":
        return {"prompt": PROMPT, "logprobs": 5, **common}
    return {"messages": [{"role": "user", "content": PROMPT}], "logprobs": True, "top_logprobs": 5, **common}


def check_logprobs(payload: Any) -> None:
    for choice in payload.get("choices", []):
        lp = choice.get("logprobs")
        if lp is None:
            continue
        values = list(numbers(lp.get("token_logprobs", []))) + list(numbers(lp.get("top_logprobs", [])))
        for entry in lp.get("content") or []:
            values.append(entry["logprob"])
            values.extend(t["logprob"] for t in entry["top_logprobs"])
        assert values, payload
        assert all(math.isfinite(v) and -9999.0 <= v <= 0.0 for v in values), values


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_in_range_extremes_answer_strict_json_with_finite_logprobs(
    tiny_server: ServerProcess, endpoint: str, stream: bool
) -> None:
    with httpx.Client(base_url=tiny_server.url, timeout=120) as client:
        for params in IN_RANGE:
            response = client.post(endpoint, json=body_for(endpoint, params, stream))
            assert response.status_code == 200, (params, response.text)
            if not stream:
                payload = strict_loads(response.text)
                check_logprobs(payload)
                assert len(payload["choices"]) == params.get("n", 1)
                continue
            events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]", (params, response.text[-500:])
            for event in events[:-1]:
                payload = strict_loads(event)
                assert "error" not in payload, (params, payload)
                check_logprobs(payload)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_out_of_range_values_are_a_400_naming_the_field(tiny_server: ServerProcess, endpoint: str) -> None:
    with httpx.Client(base_url=tiny_server.url, timeout=60) as client:
        for params, field in OUT_OF_RANGE:
            for stream in (False, True):
                response = client.post(endpoint, json=body_for(endpoint, params, stream))
                assert response.status_code == 400, (params, response.text)
                error = strict_loads(response.text)["error"]
                assert field in error["message"], (params, error)
                assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_json_numbers_are_refused(tiny_server: ServerProcess, literal: str) -> None:
    # Python's json (and so FastAPI) parses these literals; the models must refuse them.
    raw = '{"prompt": "hi", "max_tokens": 4, "logprobs": 2, "repetition_penalty": ' + literal + "}"
    response = httpx.post(
        f"{tiny_server.url}/v1/completions", content=raw, headers={"Content-Type": "application/json"}, timeout=60
    )
    assert response.status_code == 400, response.text
    assert "repetition_penalty" in strict_loads(response.text)["error"]["message"]


def test_logit_bias_steers_the_real_sampler(tiny_server: ServerProcess) -> None:
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 1.0, "logit_bias": {"42": 100}, "logprobs": 1}
    response = httpx.post(f"{tiny_server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    text_42 = httpx.post(f"{tiny_server.url}/detokenize", json={"tokens": [42]}).json()["prompt"]
    assert response.json()["choices"][0]["logprobs"]["tokens"] == [text_42] * 5

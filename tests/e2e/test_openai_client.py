"""The official openai client against a real `stoker serve` on the default
model (one server for the whole session)."""

from __future__ import annotations

import asyncio
import base64
import struct
import time

import httpx
import openai
import pytest
from conftest import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
MODEL = "smollm2-135m-instruct"
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def client(real_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{real_server.url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture
def aclient(real_server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{real_server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_models(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL, "all-MiniLM-L6-v2"]


def test_chat_sync_stream_and_not(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    text = full.choices[0].message.content
    assert text and full.usage.completion_tokens <= 12 and full.choices[0].finish_reason in ("stop", "length")
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # The same prompt again hits the prefix cache.
    again = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


async def test_chat_and_completions_async(aclient: openai.AsyncOpenAI) -> None:
    stream = await aclient.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, stream=True, seed=1)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text
    completion = await aclient.completions.create(model=MODEL, prompt="The sky is", max_tokens=8, n=2, seed=3)
    assert len(completion.choices) == 2 and all(c.text for c in completion.choices)
    stream = await aclient.completions.create(model=MODEL, prompt="The sky is", max_tokens=8, stream=True)
    assert "".join([c.choices[0].text async for c in stream])


def test_completions_sync(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=["One, two,", "A, B,"], max_tokens=5, temperature=0, logprobs=2)
    assert [c.index for c in out.choices] == [0, 1]
    assert len(out.choices[0].logprobs.tokens) == out.usage.completion_tokens // 2 or out.choices[0].logprobs


def test_embeddings(client: openai.OpenAI) -> None:
    for fmt in ("float", "base64"):
        out = client.embeddings.create(model="all-MiniLM-L6-v2", input=["hello", "world"], encoding_format=fmt)
        vectors = [d.embedding for d in out.data]
        if fmt == "base64":  # asked for explicitly, the client hands the string through
            vectors = [list(struct.unpack("<384f", base64.b64decode(v))) for v in vectors]
        assert len(vectors) == 2 and len(vectors[0]) == 384
        assert abs(sum(x * x for x in vectors[0]) - 1.0) < 1e-3
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="all-MiniLM-L6-v2", input="x", dimensions=8)


def test_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    with pytest.raises(openai.BadRequestError, match="1024"):
        client.completions.create(model=MODEL, prompt="hi " * 1000, max_tokens=100)


def test_greedy_matches_offline_llm(client: openai.OpenAI) -> None:
    from stoker.engine.llm import LLM
    from stoker.engine.params import SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):"]
    served = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0).choices[0].text for p in prompts
    ]
    llm = LLM(max_model_len=1024, max_num_seqs=4)
    # One prompt at a time, as the server ran them: in bf16 a different batch
    # shape may legitimately flip a near-tie; fp32 fidelity is the engine's own test.
    greedy = SamplingParams(max_tokens=24, temperature=0)
    offline = [llm.generate(p, greedy)[0].outputs[0].text for p in prompts]
    assert served == offline


async def test_32_concurrent_streams(aclient: openai.AsyncOpenAI) -> None:
    async def one(i: int) -> int:
        stream = await aclient.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Count to {i}."}],
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        assert chunks[-2].choices[0].finish_reason in ("stop", "length")
        return chunks[-1].usage.completion_tokens

    start = time.monotonic()
    tokens = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(32))), timeout=600)
    assert all(t > 0 for t in tokens)
    print(f"32 streams: {sum(tokens)} tokens in {time.monotonic() - start:.1f} s")


def test_disconnect_frees_kv_blocks(real_server: ServerProcess) -> None:
    def stats() -> dict:
        return httpx.get(f"{real_server.url}/ready", timeout=10).json()["engine_stats"]

    deadline = time.monotonic() + 60
    while stats()["num_running"] or stats()["num_waiting"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    idle = stats()["kv_blocks_used"]
    body = {
        "model": MODEL,
        "prompt": "Write a long story about a dragon.",
        "max_tokens": 900,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{real_server.url}/v1/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()
        for _ in range(4):
            next(lines)
        assert stats()["kv_blocks_used"] > idle
    deadline = time.monotonic() + 10
    while stats()["kv_blocks_used"] != idle or stats()["num_running"]:
        assert time.monotonic() < deadline, stats()
        time.sleep(0.1)

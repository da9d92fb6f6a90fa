"""LoRA adapters through the engine process (issue 38): AsyncEngineClient
registers them in a real engine on a tiny model, refuses a bad one in one
line, rejects requests naming an unknown one, and registers its adapters
again when a crashed engine restarts."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tiny_loras import ATTENTION, make_peft_adapter
from tiny_models import make_tiny_hf_model

from stoker.config import EngineConfig
from stoker.engine.client import AsyncEngineClient, LoraRejectedError, RequestRejectedError
from stoker.engine.params import EngineCoreRequest, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [5, 17, 300, 42, 9, 77, 1000, 3]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("lora-client")
    base = make_tiny_hf_model("llama", root / "base")
    return base, make_peft_adapter(base, root / "attn", rank=4, targets=ATTENTION, seed=1)


@pytest.fixture
async def client(files: tuple[Path, Path]) -> AsyncIterator[AsyncEngineClient]:
    config = EngineConfig(model=str(files[0]), dtype="float32", num_kv_blocks=64, block_size=4)
    c = AsyncEngineClient(config, startup_timeout=120)
    await c.start()
    try:
        yield c
    finally:
        await c.shutdown()


async def greedy(client: AsyncEngineClient, lora: str | None) -> list[int]:
    request = EngineCoreRequest(f"r-{time.monotonic_ns()}", PROMPT, GREEDY, time.time(), lora_name=lora)
    return [t async for delta in client.generate(request) for t in delta.new_token_ids]


async def test_adapters_registered_served_refused_and_registered_again_after_a_crash(
    client: AsyncEngineClient, files: tuple[Path, Path]
) -> None:
    info = await client.add_lora("attn", str(files[1]))
    assert (info.name, info.rank, info.target_modules) == ("attn", 4, tuple(sorted(ATTENTION)))
    with pytest.raises(LoraRejectedError, match=r"^LoRA adapter 'bad': cannot read /nowhere"):
        await client.add_lora("bad", "/nowhere")
    assert client.lora_names() == ["attn"]
    adapted, base = await greedy(client, "attn"), await greedy(client, None)
    assert adapted != base
    with pytest.raises(RequestRejectedError, match="LoRA adapter 'other' is not registered"):
        await greedy(client, "other")
    assert client.stats().lora_registered == 1

    assert client.info is not None
    os.kill(client.info.pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while not (client.ready and client.restart_count == 1):
        assert time.monotonic() < deadline, "the engine did not restart"
        await asyncio.sleep(0.05)
    assert client.lora_names() == ["attn"]
    assert await greedy(client, "attn") == adapted

    await client.remove_lora("attn")
    await client.remove_lora("never-added")  # unknown: nothing happens
    assert client.lora_names() == []
    with pytest.raises(RequestRejectedError, match="not registered"):
        await greedy(client, "attn")

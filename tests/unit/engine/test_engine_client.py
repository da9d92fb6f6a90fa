"""AsyncEngineClient routing: a consumer that lags behind the engine by a step
still receives every delta, the finishing one included."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

from stoker.config import EngineConfig
from stoker.engine.client import AsyncEngineClient
from stoker.engine.params import EngineCoreOutput, EngineCoreRequest, FinishReason, SamplingParams


def _delta(request_id: str, index: int, token: int, finish: FinishReason | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, index, [token], chr(97 + token % 26), None, 3, 0, finish)


async def test_lagging_consumer_gets_the_final_delta() -> None:
    client = AsyncEngineClient(EngineConfig(), "unused:Core", 1.0)
    sent: list[list[bytes]] = []
    client._engine = SimpleNamespace(inp=SimpleNamespace(send_multipart=lambda frames, flags=0: sent.append(frames)))
    client._alive = True
    request = EngineCoreRequest("r1", [1, 2, 3], SamplingParams(n=2, max_tokens=3), 0.0)
    stream = client.generate(request)
    first = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)
    # Three steps arrive before the consumer runs again: the dispatcher has
    # already counted both finishes while two items still wait in the queue.
    client._dispatch([_delta("r1", 0, 1), _delta("r1", 1, 2)])
    client._dispatch([_delta("r1", 0, 3, FinishReason.LENGTH), _delta("r1", 1, 4)])
    client._dispatch([_delta("r1", 1, 5, FinishReason.STOP)])
    got = [await first] + [d async for d in stream]
    assert [(d.index, d.new_token_ids[0]) for d in got] == [(0, 1), (1, 2), (0, 3), (1, 4), (1, 5)]
    assert sum(d.finished for d in got) == 2
    assert client.num_in_flight == 0
    client._engine = None
    await client.shutdown()
    assert not os.path.exists(client._dir)

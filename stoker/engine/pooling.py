"""A reranker's engine client: in place of an engine process, a
cross-encoder and its micro-batcher inside the front end's process.

The fleet gives each model version an engine client to start, drain and end;
a reranker's version gets this one, so it joins the fleet as a chat model
does (--model NAME=PATH, digest pins, hot swap and canary through the admin
API, drain on retire, /v1/models) while its forward passes run in a worker
thread of the front end, never on a chat engine's step loop. It generates
nothing: a generation request reaching it is refused with a 400 naming its
kind (the routes check the kind first; this is the last word).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator

from stoker.config import EngineConfig, ModelConfig
from stoker.engine.client import AsyncEngineClient, RequestRejectedError
from stoker.engine.params import EngineCoreOutput, EngineCoreRequest
from stoker.engine.process import EngineInfo
from stoker.models.cross_encoder import CrossEncoder, PairBatcher
from stoker.models.identity import model_name

DEFAULT_BATCH = 32


class PoolingEngine(AsyncEngineClient):
    """The engine client of a reranker version. The base client's process
    plumbing stays unused (no engine process ever starts): its requests to an
    engine answer "not ready"."""

    def __init__(self, config: EngineConfig, max_batch: int = DEFAULT_BATCH) -> None:
        super().__init__(config)
        self.max_batch = max_batch
        self.batcher: PairBatcher | None = None

    @property
    def name(self) -> str:
        assert self.config.model is not None
        return self.config.served_model_name or model_name(self.config.model)

    @property
    def ready(self) -> bool:
        return self.batcher is not None and not self._closing

    @property
    def num_in_flight(self) -> int:
        return self.batcher.waiting if self.batcher is not None else 0

    async def start(self) -> EngineInfo:
        assert self.config.model is not None
        started = time.monotonic()
        model = await asyncio.to_thread(CrossEncoder, self.config.model, self.name)
        heads = model.num_heads
        self.info = EngineInfo(
            max_model_len=model.max_tokens,
            model_config=ModelConfig(
                architecture=model.architecture,
                vocab_size=model.vocab_size,
                hidden_size=model.hidden_size,
                intermediate_size=model.intermediate_size,
                num_layers=model.num_layers,
                num_heads=heads,
                num_kv_heads=heads,
                head_dim=model.hidden_size // heads,
                max_position_embeddings=model.max_position_embeddings,
                rms_norm_eps=model.layer_norm_eps,
                rope_theta=0.0,
                name=self.name,
            ),
            kv_capacity_tokens=0,
            load_seconds=time.monotonic() - started,
            pid=os.getpid(),  # it runs in the front end's own process
            tokenizer=b"",
            weights=f"F32 (numpy, in the front end), {model.parameter_bytes() / 2**20:.0f} MiB",
        )
        self.tokenizer = model.tokenizer
        self.batcher = PairBatcher(model, self.max_batch)
        return self.info

    async def shutdown(self, timeout: float = 10.0) -> None:
        if self.batcher is not None:
            self.batcher.close()
        await super().shutdown(timeout)

    async def sleep(self, timeout: float = 10.0) -> None:
        """Drop the cross-encoder (its arrays are the memory a reranker holds); wake() reads it again."""
        batcher, self.batcher = self.batcher, None
        if batcher is not None:
            batcher.close()

    async def wake(self) -> EngineInfo:
        return await self.start()

    def generate(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        raise RequestRejectedError(f"model {self.name} is a reranker: it serves /v1/rerank and /v1/score only")

    async def reset_prefix_cache(self, timeout: float = 10.0) -> int:
        return 0  # no KV cache, nothing to forget

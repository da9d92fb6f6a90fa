"""A generation request as the engine serves it: one engine request per
prompt, n samples each, their outputs folded as they come, its usage and the
record the finished hooks get."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import NotRequired, TypedDict

from fastapi import Request

from stoker.engine.client import AsyncEngineClient
from stoker.engine.params import (
    CompletionOutput,
    EngineCoreOutput,
    EngineCoreRequest,
    KVTransferParams,
    RequestOutput,
    SamplingParams,
)
from stoker.server.hooks import FinishedRecord


class CachedTokens(TypedDict):
    cached_tokens: int


class ReasoningTokens(TypedDict):
    reasoning_tokens: int


class Usage(TypedDict):
    """A job's token counts in OpenAI's shape; the other APIs rename them."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: CachedTokens
    completion_tokens_details: NotRequired[ReasoningTokens]
    """Where the model thinks (SamplingParams.reasoning): the thinking's share of completion_tokens."""


@dataclass
class Job:
    """One HTTP generation request: one engine request per prompt, n samples each."""

    endpoint: str
    model: str
    prompts: list[list[int]]
    params: SamplingParams
    prompt_texts: list[str | None]
    priority: int = 0
    deadline: float | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """The server's id for the request (response ids, engine ids, log line, usage
    row); never the client's X-Request-Id, which is only echoed and logged."""
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.time)
    outputs: list[RequestOutput] = field(default_factory=list)
    engine_request_id: str = ""
    """Base of the engine's request ids: request_id, suffixed only if that id is
    already in flight (a request retried on a fallback model); set by run_job."""
    errors: set[str] = field(default_factory=set)
    """Engine errors seen on finished samples (e.g. "deadline")."""
    version: str | None = None
    """The model version that serves it ("v2"), for per-version metrics during a canary."""
    lora_name: str | None = None
    """The LoRA adapter its engine requests apply (the model it names is an adapter); None: the base model."""
    kv_transfer: KVTransferParams | None = None
    """Its half of a request a PD router split between a prefill and a decode worker (server/kv_roles.py)."""
    charged: bool = True
    """Whether its usage counts against its key (rate limits, budget, ledger); False for a prefill
    worker's half, which the decode worker's half is charged for."""

    def __post_init__(self) -> None:
        n = self.params.n
        self.outputs = [
            RequestOutput("", text, ids, [CompletionOutput(index=k) for k in range(n)])
            for ids, text in zip(self.prompts, self.prompt_texts)
        ]

    @property
    def deadline_missed(self) -> bool:
        return "deadline" in self.errors

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for o in self.outputs for c in o.outputs)

    def choice_index(self, prompt_index: int, sample_index: int) -> int:
        return prompt_index * self.params.n + sample_index

    def usage(self) -> Usage:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.token_ids) for o in self.outputs for c in o.outputs)
        cached = sum(o.num_cached_tokens for o in self.outputs)
        usage: Usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if self.params.reasoning is not None:
            thinking = sum(c.num_reasoning_tokens for o in self.outputs for c in o.outputs)
            usage["completion_tokens_details"] = {"reasoning_tokens": thinking}
        return usage

    def record(self, status: int, error: str | None, stream: bool, request: Request) -> FinishedRecord:
        usage = self.usage()
        samples = [c for o in self.outputs for c in o.outputs]
        return FinishedRecord(
            request_id=self.request_id,
            endpoint=self.endpoint,
            model=self.model,
            model_version=self.version,
            status=status,
            prompt_tokens=usage["prompt_tokens"],
            completion_tokens=usage["completion_tokens"],
            cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
            finish_reasons=[c.finish_reason.value for c in samples if c.finish_reason is not None],
            times=[c.times for c in samples if c.times is not None],
            error=error,
            stream=stream,
            started=self.started,
            http_request=request,
            engine_request_id=self.engine_request_id,
            draft_tokens=sum(c.num_draft_tokens for c in samples),
            accepted_draft_tokens=sum(c.num_accepted_draft_tokens for c in samples),
            charged=self.charged,
        )


async def run_job(
    engine: AsyncEngineClient, job: Job, in_use: set[str], lora_in_flight: Counter[str] | None = None
) -> AsyncGenerator[tuple[int, EngineCoreOutput], None]:
    """Yield (prompt index, delta) for every prompt of the job, folding each
    delta into job.outputs. Several prompts run concurrently in the engine.

    The engine request id is the job's request id (with -0, -1, ... per prompt
    when there are several), so logs of both processes line up. It is the
    server's own id, so no client can aim at another's engine request (abort,
    deadline, duplicate refusal); in_use holds the ids of jobs in flight all the
    same, so a job retried under the same id never meets its own earlier try
    (the engine refuses duplicates). lora_in_flight counts the jobs of each
    adapter in the engine, which an adapter's unload waits for."""
    base = job.request_id
    if base in in_use:
        base = f"{base}.{uuid.uuid4().hex[:8]}"
    in_use.add(base)
    job.engine_request_id = base
    lora = job.lora_name
    if lora is not None and lora_in_flight is not None:
        lora_in_flight[lora] += 1
    try:
        async for item in _run_job(engine, job, base):
            yield item
    finally:
        in_use.discard(base)
        if lora is not None and lora_in_flight is not None:
            lora_in_flight[lora] -= 1


def _fold(job: Job, index: int, delta: EngineCoreOutput) -> None:
    job.outputs[index].apply(delta)
    if delta.error:
        job.errors.add(delta.error)


async def _run_job(engine: AsyncEngineClient, job: Job, base: str) -> AsyncIterator[tuple[int, EngineCoreOutput]]:
    for i, output in enumerate(job.outputs):
        output.request_id = base if len(job.outputs) == 1 else f"{base}-{i}"
    requests = [
        EngineCoreRequest(
            o.request_id,
            o.prompt_token_ids,
            job.params,
            job.started,
            job.priority,
            job.deadline,
            job.lora_name,
            kv_transfer=job.kv_transfer,
        )
        for o in job.outputs
    ]
    if len(requests) == 1:
        async for delta in engine.generate(requests[0]):
            _fold(job, 0, delta)
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, EngineCoreOutput] | BaseException | None] = asyncio.Queue()

    async def pump(i: int, req: EngineCoreRequest) -> None:
        try:
            async for delta in engine.generate(req):
                queue.put_nowait((i, delta))
            queue.put_nowait(None)
        except Exception as exc:
            queue.put_nowait(exc)

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        done = 0
        while done < len(tasks):
            item = await queue.get()
            if item is None:
                done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                _fold(job, *item)
                yield item
    finally:
        for task in tasks:  # cancelling a pump closes its engine stream, which aborts it
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

"""The load generator: streams requests at an OpenAI-compatible server in a
closed loop (fixed concurrency), an open loop (Poisson arrivals) or a burst,
and records what the client saw for each request.

Requests are standard OpenAI plus vLLM's `ignore_eos` field when asked for; a
server that rejects that field shows up as failed requests, not as a crash."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import httpx

from stoker.bench.stats import RequestResult, alternating_schedule, summarize
from stoker.bench.workload import RequestSpec, as_messages, as_prompt

if TYPE_CHECKING:
    from rich.console import Console


@dataclass
class Stage:
    """One load shape: closed loop at `value` concurrent clients, Poisson
    arrivals at `value` req/s, or everything at once."""

    mode: str  # "closed" | "poisson" | "burst"
    value: float | None = None

    @property
    def label(self) -> str:
        if self.mode == "closed":
            return f"c={int(self.value or 1)}"
        if self.mode == "poisson":
            return f"rate={self.value:g}/s"
        return "burst"


@dataclass
class Target:
    url: str
    """Base URL without /v1."""
    label: str
    model: str | None = None
    models: list[str] = field(default_factory=list)
    """Model names its requests take in turn (request i names models[i % len]), e.g. LoRA adapters
    of one base; empty: every request names `model`."""

    def model_for(self, index: int) -> str | None:
        return self.models[index % len(self.models)] if self.models else self.model


@dataclass
class BenchConfig:
    targets: list[Target]
    stages: list[Stage]
    endpoint: str = "chat"  # "chat" | "completions"
    num_requests: int = 100
    duration: float | None = None
    """Seconds after which no new request starts (in-flight ones finish)."""
    repeats: int = 1
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float | None = None
    timeout: float = 600.0
    warmup: int = 1
    seed: int = 0
    extra_body: dict[str, object] = field(default_factory=dict)
    prefix_fill: list[RequestSpec] = field(default_factory=list)
    """Sent to each target once after its warm-up, unrecorded, one at a time: the
    shared prefixes alone, so every one is computed before a run measures."""
    between_runs: str | None = None
    """Shell command run before each measured run (a restart step, say); then the
    target's /ready (or /health) must answer 200 within ready_timeout."""
    ready_timeout: float = 600.0


class BetweenRunsError(RuntimeError):
    """The --between-runs command failed, or the target was not ready after it."""


def make_targets(urls: list[str], model: str | None = None, models: list[str] | None = None) -> list[Target]:
    """models: one comma-separated list of names per URL, in order (one list alone: for every URL)."""
    rounds = [[m.strip() for m in entry.split(",") if m.strip()] for entry in models or []]
    if len(rounds) > 1 and len(rounds) != len(urls):
        raise ValueError(f"--models was given {len(rounds)} times for {len(urls)} servers: once, or once per server")
    targets: list[Target] = []
    for i, url in enumerate(urls):
        base = url.rstrip("/")
        base = base.removesuffix("/v1")
        label = urlparse(base).netloc or base
        if any(t.label == label for t in targets):
            label = f"{label}#{i}"
        names = rounds[i if len(rounds) > 1 else 0] if rounds else []
        targets.append(Target(base, label, model, names))
    return targets


def build_payload(spec: RequestSpec, cfg: BenchConfig, model: str | None) -> dict[str, object]:
    payload: dict[str, object] = {
        "model": model or "default",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.endpoint == "chat":
        payload["messages"] = as_messages(spec)
    else:
        payload["prompt"] = as_prompt(spec)
    if spec.output_len is not None:
        payload["max_tokens"] = spec.output_len
    if cfg.ignore_eos:
        payload["ignore_eos"] = True  # vLLM's extension; stoker and llama.cpp honour it too
    if cfg.temperature is not None:
        payload["temperature"] = cfg.temperature
    payload.update(cfg.extra_body)
    return payload


def _headers(cfg: BenchConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, object],
    headers: dict[str, str],
    index: int,
    t_run: float,
    input_len: int | None,
) -> RequestResult:
    """One streamed request. Never raises: every failure becomes a result."""
    r = RequestResult(index=index, prompt_tokens=input_len or 0)
    t0 = time.perf_counter()
    r.start = t0 - t_run
    chunks, last, finished, usage = 0, t0, False, None
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            r.status = resp.status_code
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                r.error = f"HTTP {resp.status_code}: {body[:200]}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    finished = True
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    r.error = f"stream error: {json.dumps(obj['error'])[:200]}"
                    return r
                usage = obj.get("usage") or usage
                for choice in obj.get("choices") or []:
                    text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter()
                        if r.ttft is None:
                            r.ttft = now - t0
                        else:
                            r.itls.append(now - last)
                        last, chunks = now, chunks + 1
                    if choice.get("finish_reason"):
                        finished = True
    except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        r.error = f"{type(exc).__name__}: {exc}"[:300]
        return r
    r.e2e = time.perf_counter() - t0
    if not finished:
        r.error = "incomplete stream: closed before finish_reason or [DONE]"
        return r
    if usage:
        r.prompt_tokens = int(usage.get("prompt_tokens") or r.prompt_tokens)
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            r.cached_tokens = int(details["cached_tokens"])
        r.output_tokens = int(usage.get("completion_tokens") or chunks)
    else:  # without usage, one content chunk is taken as one token
        r.output_tokens = chunks
    r.ok = r.ttft is not None
    if not r.ok:
        r.error = "no tokens in the stream"
    return r


Callback = Callable[[RequestResult], None]


async def run_stage(
    client: httpx.AsyncClient,
    target: Target,
    stage: Stage,
    specs: list[RequestSpec],
    cfg: BenchConfig,
    on_done: Callback | None = None,
    rep: int = 0,
) -> tuple[list[RequestResult], float]:
    """One stage against one target: returns every request's result and the
    wall time from the first send to the last answer."""
    url = f"{target.url}/v1/{'chat/completions' if cfg.endpoint == 'chat' else 'completions'}"
    headers = _headers(cfg)
    results: list[RequestResult] = []
    t_run = time.perf_counter()
    deadline = t_run + cfg.duration if cfg.duration else float("inf")

    async def one(i: int) -> None:
        spec = specs[i % len(specs)]
        payload = build_payload(spec, cfg, target.model_for(i))
        res = await send_request(client, url, payload, headers, i, t_run, spec.input_len)
        results.append(res)
        if on_done:
            on_done(res)

    if stage.mode == "closed":
        counter = itertools.count()

        async def worker() -> None:
            while (i := next(counter)) < cfg.num_requests and time.perf_counter() < deadline:
                await one(i)

        await asyncio.gather(*(worker() for _ in range(int(stage.value or 1))))
    else:
        # Same seed per (stage, repetition): every target sees the same arrival times.
        rng = random.Random(f"{cfg.seed}/{stage.label}/{rep}")
        tasks, t_next = [], t_run
        for i in range(cfg.num_requests):
            if stage.mode == "poisson":
                await asyncio.sleep(max(0.0, t_next - time.perf_counter()))
                t_next += rng.expovariate(float(stage.value or 1.0))
            if time.perf_counter() >= deadline:
                break
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    duration = time.perf_counter() - t_run
    results.sort(key=lambda x: x.index)
    return results, duration


async def discover_model(client: httpx.AsyncClient, target: Target, cfg: BenchConfig) -> str | None:
    """The first model the server lists, when --model was not given."""
    try:
        resp = await client.get(f"{target.url}/v1/models", headers=_headers(cfg))
        data = resp.json().get("data") or []
        return data[0]["id"] if data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return None


async def wait_ready(client: httpx.AsyncClient, target: Target, cfg: BenchConfig) -> None:
    """Until the target's /ready answers 200 (/health where it has no /ready: vLLM, llama.cpp)."""
    deadline = time.perf_counter() + cfg.ready_timeout
    path = "/ready"
    while True:
        try:
            status = (await client.get(f"{target.url}{path}", headers=_headers(cfg))).status_code
        except httpx.HTTPError:
            status = None  # restarting: not listening yet
        if status == 200:
            return
        if status == 404 and path == "/ready":
            path = "/health"
            continue
        if time.perf_counter() > deadline:
            raise BetweenRunsError(f"{target.url}{path} did not answer 200 within {cfg.ready_timeout:g} s")
        await asyncio.sleep(0.5)


async def run_between(client: httpx.AsyncClient, cfg: BenchConfig, target: Target, stage: Stage, rep: int) -> None:
    """The --between-runs command before one measured run, told which in its environment."""
    assert cfg.between_runs is not None
    env = {
        **os.environ,
        "STOKER_BENCH_URL": target.url,
        "STOKER_BENCH_TARGET": target.label,
        "STOKER_BENCH_STAGE": stage.label,
        "STOKER_BENCH_REPETITION": str(rep),
    }
    process = await asyncio.create_subprocess_shell(cfg.between_runs, env=env)
    code = await process.wait()
    if code != 0:
        raise BetweenRunsError(
            f"--between-runs exited with {code} before the run {target.label} {stage.label} #{rep}: {cfg.between_runs}"
        )
    await wait_ready(client, target, cfg)


async def kv_capacity_tokens(client: httpx.AsyncClient, target: Target, cfg: BenchConfig) -> int | None:
    """The tokens a server's KV cache holds, as SGLang's /server_info says (stoker answers it
    in open mode or to a router or admin key); None where it does not say."""
    try:
        response = await client.get(f"{target.url}/server_info", headers=_headers(cfg))
        value = response.json().get("max_total_num_tokens") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, int) else None


async def print_prefix_working_set(console: Console, cfg: BenchConfig, length: int, count: int) -> None:
    """How many of the shared prefixes each server's KV cache can hold at once: a
    workload meant to overflow the RAM tier should say that it does."""
    console.print(f"shared prefixes: {count} x {length} tokens = {count * length} tokens")
    async with httpx.AsyncClient(timeout=10) as client:
        for target in cfg.targets:
            capacity = await kv_capacity_tokens(client, target, cfg)
            if capacity is not None:
                console.print(f"  {target.label}: KV cache {capacity} tokens, holds {capacity // length} of them")


Workload = list[RequestSpec] | Callable[[int], list[RequestSpec]]


async def run_bench(
    cfg: BenchConfig,
    workload: Workload,
    on_done: Callback | None = None,
    on_run: Callable[[Target, Stage, int, int], None] | None = None,
    slo: dict[str, float] | None = None,
) -> list[dict[str, object]]:
    """Every stage against every target, targets alternating within each
    repetition (A, B, A, B ...). Returns one dict per run, for stats and report.

    `workload(k)` gives the prompts of the k-th (stage, repetition): the same
    for every target, fresh for each k, so a server's prefix cache cannot
    answer a later stage from an earlier one. A plain list is reused as is."""
    make = workload if callable(workload) else (lambda k: workload)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(cfg.timeout, connect=min(cfg.timeout, 30.0))
    runs: list[dict[str, object]] = []
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        for target in cfg.targets:
            if target.model is None and not target.models:
                target.model = await discover_model(client, target, cfg)
            for i in range(cfg.warmup):  # first requests pay for lazy init and cold caches
                spec = RequestSpec(prompt="Warm up.", messages=None, output_len=8)
                await send_request(
                    client,
                    f"{target.url}/v1/{'chat/completions' if cfg.endpoint == 'chat' else 'completions'}",
                    build_payload(spec, cfg, target.model_for(i)),
                    _headers(cfg),
                    -1 - i,
                    time.perf_counter(),
                    None,
                )
            url = f"{target.url}/v1/{'chat/completions' if cfg.endpoint == 'chat' else 'completions'}"
            for i, spec in enumerate(cfg.prefix_fill):
                filled = await send_request(
                    client,
                    url,
                    build_payload(spec, cfg, target.model_for(i)),
                    _headers(cfg),
                    -1 - i,
                    time.perf_counter(),
                    None,
                )
                if not filled.ok:
                    raise BetweenRunsError(f"filling prefix {i} on {target.label} failed: {filled.error}")
        for s_index, stage in enumerate(cfg.stages):
            specs: list[RequestSpec] = []
            for rep, label in alternating_schedule([t.label for t in cfg.targets], cfg.repeats):
                if label == cfg.targets[0].label:  # each repetition starts with the first target
                    specs = make(s_index * cfg.repeats + rep)
                    if not specs:
                        raise ValueError("empty workload")
                target = next(t for t in cfg.targets if t.label == label)
                if cfg.between_runs:
                    await run_between(client, cfg, target, stage, rep)
                if on_run:
                    on_run(target, stage, rep, cfg.num_requests)
                results, duration = await run_stage(client, target, stage, specs, cfg, on_done, rep)
                runs.append(
                    {
                        "target": target.label,
                        "url": target.url,
                        "model": ",".join(target.models) or target.model,
                        "stage": stage.label,
                        "mode": stage.mode,
                        "stage_value": stage.value,
                        "repetition": rep,
                        "summary": summarize(results, duration, slo),
                        "requests": [r.to_dict() for r in results],
                    }
                )
    return runs

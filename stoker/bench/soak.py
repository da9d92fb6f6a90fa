"""Soak mode of `stoker bench serve`: a long mixed load (plain and streamed
requests, clients that hang up mid-stream, malformed requests) while the RSS
of the server's processes is sampled, to show whether memory stays flat.

The server's processes are found from its pid by walking /proc (no psutil):
the pid itself is the front end; a child started by multiprocessing's
spawn_main is the engine; any other descendant is listed under its own name.
Growth is judged over the last minutes only, so warm-up (caches, lazily
touched pages) does not count as a leak."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from stoker.bench.workload import random_words


@dataclass
class SoakConfig:
    url: str
    """Base URL without /v1."""
    model: str | None = None
    endpoint: str = "completions"  # "completions" | "chat"
    duration: float = 600.0
    concurrency: int = 16
    prompt_words: tuple[int, int] = (3, 300)
    max_tokens: tuple[int, int] = (1, 128)
    stream_share: float = 0.5
    cancel_share: float = 0.25
    """Share of the streamed requests that the client abandons mid-stream."""
    bad_share: float = 0.05
    pid: int | None = None
    """The server's pid; without it no RSS is sampled."""
    rss_interval: float = 5.0
    warmup: float = 60.0
    """Seconds after which the 'after warm-up' RSS is read."""
    growth_window: float = 5.0
    """Minutes at the end over which growth is measured."""
    api_key: str | None = None
    timeout: float = 300.0
    seed: int = 0


@dataclass
class Outcome:
    """One request as the client saw it. kind: json | stream | cancel | bad."""

    kind: str
    start: float
    status: int | None = None
    ok: bool = False
    """json/stream: completed; cancel: hung up as planned (or completed first); bad: answered 4xx."""
    error: str | None = None
    seconds: float = 0.0
    chunks: int = 0


# ------------------------------------------------------------- processes


def _ppid_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name in parentheses may itself hold spaces or parentheses.
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def process_tree(root: int) -> list[int]:
    """root and every live descendant, root first."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (ppid := _ppid_of(int(name))) is not None:
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo += sorted(children.get(pid, []))
    return out if os.path.exists(f"/proc/{root}") else []


def memory_of(pid: int) -> dict[str, int] | None:
    """VmRSS and its anonymous / file-backed parts in bytes; None if the process is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return None
    kb = {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "RssAnon", "RssFile") if k in fields}
    return {"rss": kb.get("VmRSS", 0), "anon": kb.get("RssAnon", 0), "file": kb.get("RssFile", 0)}


def cmdline_of(pid: int) -> str:
    """The process's command line, arguments joined by spaces; empty if it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def front_end_of(tree: list[int]) -> int:
    """The server itself: the first `stoker ... serve` in the tree, so a --pid
    of a wrapper (a shell, `timeout`) still finds it; else the root."""
    for pid in tree:
        cmdline = cmdline_of(pid)
        if "stoker" in cmdline and "serve" in cmdline and "spawn_main" not in cmdline:
            return pid
    return tree[0]


def role_of(pid: int, front: int) -> str:
    if pid == front:
        return "front end"
    cmdline = cmdline_of(pid)
    if "resource_tracker" in cmdline:
        return "resource tracker"
    if "spawn_main" in cmdline or "multiprocessing-fork" in cmdline:
        return "engine"
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8") as f:
            return f"{f.read().strip()} {pid}"
    except OSError:
        return f"pid {pid}"


def sample_processes(root: int) -> list[dict[str, Any]]:
    """[{pid, role, rss, anon, file}] for the server's process tree now."""
    tree = process_tree(root)
    front = front_end_of(tree) if tree else root
    out = []
    for pid in tree:
        mem = memory_of(pid)
        if mem is not None:
            out.append({"pid": pid, "role": role_of(pid, front), **mem})
    return out


def rss_summary(samples: list[dict[str, Any]], warmup: float, window_min: float) -> dict[str, dict[str, Any]]:
    """Per role: RSS at the start, after warm-up, at the end and at most, and
    the growth over the last `window_min` minutes (end minus the sample that
    many minutes before it, and a least-squares slope over the window)."""
    series: dict[str, list[tuple[float, int]]] = {}
    for s in samples:
        for p in s["procs"]:
            series.setdefault(p["role"], []).append((s["t"], p["rss"]))
    out = {}
    for role, pts in series.items():
        t_end, end = pts[-1]
        after = next((v for t, v in pts if t >= warmup), end)
        w_start = t_end - window_min * 60
        window = [(t, v) for t, v in pts if t >= w_start]
        base_t, base = window[0]
        slope = None
        if len(window) >= 2 and window[-1][0] > window[0][0]:
            mt = sum(t for t, _ in window) / len(window)
            mv = sum(v for _, v in window) / len(window)
            var = sum((t - mt) ** 2 for t, _ in window)
            slope = sum((t - mt) * (v - mv) for t, v in window) / var * 60 if var else None
        out[role] = {
            "start": pts[0][1],
            "after_warmup": after,
            "end": end,
            "max": max(v for _, v in pts),
            "window_minutes": (t_end - base_t) / 60,
            "growth": end - base,
            "growth_pct": 100.0 * (end - base) / base if base else None,
            "slope_bytes_per_min": slope,
        }
    return out


# --------------------------------------------------------------- requests

# Each must be refused with a 4xx: a 5xx or a 200 is an error of the server.
BAD_BODIES: list[tuple[str, Callable[[dict[str, Any]], dict[str, Any] | bytes]]] = [
    ("not json", lambda p: b"{this is not json"),
    ("max_tokens -1", lambda p: {**p, "max_tokens": -1}),
    ("temperature -3", lambda p: {**p, "temperature": -3}),
    ("no prompt", lambda p: {k: v for k, v in p.items() if k not in ("prompt", "messages")}),
    ("max_tokens huge", lambda p: {**p, "max_tokens": 10**9}),
    ("top_p 7", lambda p: {**p, "top_p": 7}),
]


@dataclass
class Planned:
    kind: str
    body: dict[str, Any] | bytes
    stream: bool
    cancel_after: int = 0
    """cancel: content chunks to read before hanging up (0: right after the headers)."""
    bad: str | None = None


def plan_request(cfg: SoakConfig, rng: random.Random, model: str | None) -> Planned:
    words = random_words(rng, rng.randint(*cfg.prompt_words))
    max_tokens = rng.randint(*cfg.max_tokens)
    body: dict[str, Any] = {"model": model or "default", "max_tokens": max_tokens}
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": words}]
    else:
        body["prompt"] = words
    if rng.random() < cfg.bad_share:
        name, make = rng.choice(BAD_BODIES)
        return Planned("bad", make(body), stream=rng.random() < cfg.stream_share, bad=name)
    if rng.random() >= cfg.stream_share:
        return Planned("json", body, stream=False)
    body.update(stream=True, stream_options={"include_usage": True})
    if rng.random() < cfg.cancel_share:
        return Planned("cancel", body, stream=True, cancel_after=rng.randint(0, max(0, max_tokens - 1)))
    return Planned("stream", body, stream=True)


async def send(client: httpx.AsyncClient, url: str, headers: dict[str, Any], plan: Planned, t0: float) -> Outcome:
    """One request; never raises."""
    o = Outcome(plan.kind, time.perf_counter() - t0)
    started = time.perf_counter()
    if isinstance(plan.body, bytes):
        kw: dict[str, Any] = {"content": plan.body, "headers": {**headers, "Content-Type": "application/json"}}
    else:
        kw = {"json": plan.body, "headers": headers}
    try:
        async with client.stream("POST", url, **kw) as resp:
            o.status = resp.status_code
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                o.ok = plan.kind == "bad" and 400 <= resp.status_code < 500
                if not o.ok:
                    o.error = f"HTTP {resp.status_code}: {body[:200]}"
            elif plan.kind == "bad":
                await resp.aread()
                o.error = f"bad request ({plan.bad}) accepted with 200"
            elif not plan.stream:
                data = json.loads(await resp.aread())
                o.ok = bool(data.get("choices"))
                o.error = None if o.ok else f"no choices: {json.dumps(data)[:200]}"
            else:
                await _read_stream(resp, plan, o)
    except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        o.error = f"{type(exc).__name__}: {exc}"[:300]
    o.seconds = time.perf_counter() - started
    return o


async def _read_stream(resp: httpx.Response, plan: Planned, o: Outcome) -> None:
    if plan.kind == "cancel" and plan.cancel_after == 0:
        o.ok = True  # leaving the `async with` closes the connection: the server sees a disconnect
        return
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            o.ok = True
            return
        obj = json.loads(data)
        if obj.get("error"):
            o.error = f"stream error: {json.dumps(obj['error'])[:200]}"
            return
        if any(_content(c) for c in obj.get("choices") or []):
            o.chunks += 1
            if plan.kind == "cancel" and o.chunks >= plan.cancel_after:
                o.ok = True
                return
    o.error = "incomplete stream: closed before [DONE]"


def _content(choice: dict[str, Any]) -> str | None:
    return choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")


# ---------------------------------------------------------------- the run


@dataclass
class SoakResult:
    config: dict[str, Any]
    outcomes: list[Outcome] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    """[{t, procs: [{pid, role, rss, anon, file}], done}] every rss_interval seconds."""
    health_after: int | None = None
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        by_kind = Counter(o.kind for o in self.outcomes)
        ok_by_kind = Counter(o.kind for o in self.outcomes if o.ok)
        errors = [o for o in self.outcomes if not o.ok]
        cfg = self.config
        return {
            "requests": len(self.outcomes),
            "seconds": self.seconds,
            "by_kind": dict(by_kind),
            "ok_by_kind": dict(ok_by_kind),
            "statuses": {str(k): v for k, v in sorted(Counter(str(o.status) for o in self.outcomes).items())},
            "errors": len(errors),
            "errors_by_status": dict(Counter(str(o.status) if o.status else _error_kind(o) for o in errors)),
            "error_examples": list(dict.fromkeys(o.error for o in errors if o.error))[:5],
            "health_after": self.health_after,
            "rss": rss_summary(self.samples, cfg["warmup"], cfg["growth_window"]) if self.samples else {},
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "summary": self.summary(),
            "rss_samples": self.samples,
            "requests": [asdict(o) for o in self.outcomes],
        }


def _error_kind(o: Outcome) -> str:
    return (o.error or "unknown").split(":")[0]


async def run_soak(
    cfg: SoakConfig, on_sample: Callable[[dict[str, Any], SoakResult], None] | None = None
) -> SoakResult:
    """cfg.concurrency closed-loop clients for cfg.duration seconds (requests in
    flight then finish), the RSS sampler beside them, then one GET /health."""
    result = SoakResult(config={k: v for k, v in asdict(cfg).items() if k != "api_key"})
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    url = f"{cfg.url}/v1/{'chat/completions' if cfg.endpoint == 'chat' else 'completions'}"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(cfg.timeout, connect=min(cfg.timeout, 30.0))
    t0 = time.perf_counter()
    deadline = t0 + cfg.duration
    stop = asyncio.Event()

    async def sampler() -> None:
        if cfg.pid is None:
            return
        while True:
            procs = await asyncio.to_thread(sample_processes, cfg.pid)
            sample = {"t": time.perf_counter() - t0, "procs": procs, "done": len(result.outcomes)}
            result.samples.append(sample)
            if on_sample:
                on_sample(sample, result)
            try:
                await asyncio.wait_for(stop.wait(), cfg.rss_interval)
                return
            except TimeoutError:
                pass

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = cfg.model
        if model is None:
            try:
                data = (await client.get(f"{cfg.url}/v1/models", headers=headers)).json().get("data") or []
                model = data[0]["id"] if data else None
            except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
                model = None

        async def worker(k: int) -> None:
            rng = random.Random(f"{cfg.seed}/{k}")
            while time.perf_counter() < deadline:
                result.outcomes.append(await send(client, url, headers, plan_request(cfg, rng, model), t0))

        sampling = asyncio.create_task(sampler())
        await asyncio.gather(*(worker(k) for k in range(cfg.concurrency)))
        result.seconds = time.perf_counter() - t0
        try:
            result.health_after = (await client.get(f"{cfg.url}/health", headers=headers)).status_code
        except httpx.HTTPError:
            result.health_after = None
        stop.set()
        await sampling
        if cfg.pid is not None:  # one last sample after the load, for the end figure
            procs = await asyncio.to_thread(sample_processes, cfg.pid)
            result.samples.append({"t": time.perf_counter() - t0, "procs": procs, "done": len(result.outcomes)})
    return result

"""The models a server holds: one supervised engine process per model version.

    stoker serve --model big=/m/qwen.gguf@sha256:... --model small=/m/smol.gguf --fallback big=small

A *model* is a name clients send in `model`; a *version* is one loaded copy
of a file under that name, with its own engine process and KV cache. A model
has a stable version and, during a canary, a second one taking a share of new
requests. A hot swap loads the new version beside the old one, moves new
requests to it once it is warm, and retires the old one: it stops taking
requests, its requests in flight finish, then its process ends. Requests
never see a half-loaded version, so a swap fails no request, and a failed
load leaves the old version serving.

Fallback chains (`--fallback big=small,tiny`) name the models that answer
when a model is unavailable (engine down or restarting, still loading) or
overloaded (its admission answers 503); the routes walk the chain, the fleet
only knows it and checks it (no unknown model, no cycle).

What the admin API may load is bounded (docs/models.md): a regular file or
a folder, its real path (symlinks resolved) under a --model-root (by
default the folders holding the models given at start), at most
--max-models models without --max-model-memory. Reading a model's files
(the size walk, the digest) runs in a daemon thread bounded by
--model-check-timeout and outside the fleet's lock, so a slow or endless
read ends its own load and never the next one, nor the server's shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from stoker.config import EngineConfig, default_model_path
from stoker.engine.client import AsyncEngineClient, EngineStartupError
from stoker.engine.pooling import PoolingEngine
from stoker.errors import APIError
from stoker.models.cross_encoder import ModelKind, model_kind
from stoker.models.digest import DigestCancelled, check_digest_syntax, model_digest
from stoker.models.identity import model_name
from stoker.models.readahead import WEIGHT_SUFFIXES
from stoker.models.tokenizer import Tokenizer
from stoker.server.config import ServerConfig
from stoker.server.protocol import unavailable
from stoker.server.reasoning import (
    ParserChoices,
    ParserName,
    ReasoningMarkers,
    check_model_names,
    parse_parser_choices,
    resolve_markers,
)
from stoker.server.sleep import IdleWatch, SleepChoices, VersionSleep, check_sleep_names, parse_sleep_choices
from stoker.server.structured import GrammarChecker

if TYPE_CHECKING:
    from stoker.server.lora import AdapterSpec

log = logging.getLogger("stoker.server")

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/+-]{0,127}$")
ENGINE_RUNTIME_BYTES = 480 << 20
"""What an engine process holds besides its weights and its KV cache (torch,
the kernels, the tokenizer, activations): the default 135M model's engine,
serving, measured 567 MB resident for its 98 MB file on Zen 4, with only a
few of its KV cache's pages touched yet."""

T = TypeVar("T")

KIND_WORDS: dict[ModelKind, str] = {"generate": "a chat model (kind generate)", "rerank": "a reranker (kind rerank)"}
KIND_ENDPOINTS: dict[ModelKind, str] = {
    "generate": "it serves chat, completions, responses and messages",
    "rerank": "it serves /v1/rerank and /v1/score",
}

VersionStatus = Literal["loading", "serving", "canary", "draining", "unloaded", "failed"]


class FleetError(ValueError):
    """A model set or admin call that cannot be served, in one line. The admin
    API answers it with `status` (400: the call is wrong; 409: it conflicts
    with what is loaded, e.g. memory or a load in progress)."""

    def __init__(self, message: str, status: int = 400, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param


@dataclass(frozen=True)
class ModelSpec:
    name: str
    path: str
    """A GGUF file or a Hugging Face folder (the bundled default model's path when none was given)."""
    digest: str | None = None
    """"sha256:<hex>" the files must have (stoker.models.digest), or None: not pinned."""
    named: bool = True
    """False for a bare path: the name is then the model's own (its config's), known once loaded."""
    kind: ModelKind = "generate"
    """What it serves, from its config.json (stoker.models.cross_encoder.model_kind): "generate" runs in an
    engine process; "rerank" (a sequence classifier) in the front end, for /v1/rerank and /v1/score."""


def checked_pin(digest: str | None) -> str | None:
    """digest in its one form, or None; FleetError on `digest` when it is malformed."""
    try:
        return check_digest_syntax(digest) if digest is not None else None
    except ValueError as exc:
        raise FleetError(str(exc), param="digest") from None


def checked_name(name: str) -> str:
    """check_name, its FleetError naming the `name` field."""
    try:
        return check_name(name)
    except FleetError as exc:
        raise FleetError(str(exc), param="name") from None


def checked_spec(name: str | None, path: str, digest: str | None) -> ModelSpec:
    """A spec whose path exists, digest is well formed and name is valid (None:
    named after the file); FleetError saying which is not. --model and MODEL
    check through here; the admin API through Fleet.admit (the same pin and
    name checks, its path under a model root)."""
    if not path:
        raise FleetError("no path; expected NAME=PATH[@sha256:DIGEST]", param="path")
    pinned = checked_pin(digest)
    check_model_file(path)
    kind = model_kind(path)
    if name is None:
        return ModelSpec(model_name(path), path, pinned, named=False, kind=kind)
    return ModelSpec(checked_name(name), path, pinned, kind=kind)


def check_model_file(path: str) -> None:
    """FleetError unless path is a regular file or a folder (symlinks followed):
    a device never ends (/dev/zero) and a FIFO never answers."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FleetError(f"no model at {path} (no such file or folder)", param="path") from None
    except OSError as exc:
        raise FleetError(f"cannot read {path}: {exc.strerror or exc}", param="path") from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise FleetError(f"{path} is not a regular file or a folder", param="path")


def default_model_roots(specs: Sequence[ModelSpec]) -> list[str]:
    """Where the admin API may load from when --model-root is not given: the
    folders holding the models given at start (a GGUF's folder; a Hugging Face
    folder's parent, where its next version would sit beside it)."""
    roots: list[str] = []
    for spec in specs:
        folder = os.path.dirname(os.path.realpath(spec.path))
        if folder not in roots:
            roots.append(folder)
    return roots


def allowed_model_path(path: str, roots: Sequence[str]) -> str:
    """The real path (symlinks resolved) of a model the admin API may load:
    under one of roots (real paths), a regular file or a folder. FleetError
    otherwise; outside the roots (403) it says the same whether or not the
    path exists, and nothing outside them is opened."""
    real = os.path.realpath(path)
    if not any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in roots):
        raise FleetError(
            f"path is not under an allowed model root ({_list(list(roots))}; set with --model-root)",
            403,
            "path_not_allowed",
            "path",
        )
    check_model_file(real)
    return real


def parse_model_spec(text: str, flag: str = "--model") -> ModelSpec:
    """NAME=PATH[@sha256:HEX], or PATH[@sha256:HEX] named after the file. FleetError if malformed."""
    text = text.strip()
    name: str | None
    name, sep, rest = text.partition("=")
    if not sep or os.path.exists(text.rpartition("@sha256:")[0] or text):
        name, rest = None, text  # a bare path (which may itself hold "=")
    path, at, digest = rest.rpartition("@sha256:")
    if not at:
        path = rest
    try:
        return checked_spec(name, path, "sha256:" + digest if at else None)
    except FleetError as exc:
        raise FleetError(f"{flag} {text!r}: {exc}") from None


def check_name(name: str) -> str:
    if not NAME_PATTERN.match(name):
        raise FleetError(
            f"model name {name!r}: use letters, digits and . _ : / + - (at most 128, starting with a letter or digit)"
        )
    return name


def parse_fallbacks(entries: list[str]) -> dict[str, list[str]]:
    """["big=small,tiny", ...] -> {"big": ["small", "tiny"]}; FleetError if malformed."""
    chains: dict[str, list[str]] = {}
    for entry in entries:
        head, sep, tail = entry.partition("=")
        targets = [t.strip() for t in tail.split(",") if t.strip()]
        if not sep or not head.strip() or not targets:
            raise FleetError(f"--fallback {entry!r}: expected MODEL=FALLBACK[,FALLBACK...]")
        if head.strip() in chains:
            raise FleetError(f"--fallback {entry!r}: {head.strip()} already has a fallback chain")
        chains[head.strip()] = targets
    return chains


def check_fallbacks(names: list[str], chains: dict[str, list[str]]) -> None:
    """Every model named exists, no model falls back to itself, no cycle."""
    known = set(names)
    for head, targets in chains.items():
        for name in [head, *targets]:
            if name not in known:
                raise FleetError(
                    f"--fallback {head}={','.join(targets)}: unknown model {name!r} (models: {_list(names)})"
                )
        if head in targets or len(set(targets)) != len(targets):
            raise FleetError(f"--fallback {head}={','.join(targets)}: a chain names each model once, not itself")
    for start in chains:  # follow first fallbacks: a chain of chains must end
        seen = [start]
        for nxt in chains.get(start, []):
            path = _cycle_from(nxt, chains, seen)
            if path:
                raise FleetError(f"--fallback: cycle {' -> '.join(path)}")


def _cycle_from(name: str, chains: dict[str, list[str]], seen: list[str]) -> list[str] | None:
    if name in seen:
        return [*seen, name]
    for nxt in chains.get(name, []):
        found = _cycle_from(nxt, chains, [*seen, name])
        if found:
            return found
    return None


def _list(names: list[str]) -> str:
    return ", ".join(names) or "none"


def plan_models(model: str | None, extra: list[str], served_model_name: str | None) -> list[ModelSpec]:
    """The models `stoker serve` loads: the positional MODEL (or the bundled
    default when nothing is named) and each --model. FleetError on a bad entry
    or a duplicate name."""
    specs: list[ModelSpec] = []
    if model is not None or not extra:
        specs.append(parse_model_spec(model if model is not None else default_model_path(), "MODEL"))
    specs += [parse_model_spec(text) for text in extra]
    if served_model_name and len(specs) > 1:
        raise FleetError(
            "--served-model-name names a server's only model; with several, use --model NAME=PATH for each"
        )
    if served_model_name:
        specs[0] = ModelSpec(check_name(served_model_name), specs[0].path, specs[0].digest, kind=specs[0].kind)
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise FleetError(f"two models are named {spec.name!r}; name them apart with --model NAME=PATH")
        seen.add(spec.name)
    return specs


def plan_fleet(server: ServerConfig, engine: EngineConfig) -> tuple[list[ModelSpec], dict[str, list[str]]]:
    """The models and fallback chains a server's options ask for; FleetError (one line) if they cannot be."""
    specs = plan_models(engine.model, server.models, engine.served_model_name)
    if engine.kv_events_endpoint and len(specs) > 1:
        raise FleetError(
            f"--kv-events-endpoint publishes one engine's KV cache and this server would run {len(specs)} models "
            f"({', '.join(s.name for s in specs)}): run one stoker serve per model, each with its own endpoint"
        )
    from stoker.server.lora import plan_adapters  # lora builds on this module

    chains = parse_fallbacks(server.fallback)
    adapters = plan_adapters(server.lora_modules, specs)
    check_fallbacks([s.name for s in specs] + [a.name for a in adapters], chains)
    try:
        check_model_names(parse_parser_choices(server.reasoning_parser), [s.name for s in specs])
        check_sleep_names(parse_sleep_choices(server.sleep_idle_seconds), [s.name for s in specs])
    except ValueError as exc:
        raise FleetError(str(exc)) from None
    kinds = {s.name: s.kind for s in specs} | {a.name: "generate" for a in adapters}
    for head, targets in chains.items():
        if any(kinds[t] != kinds[head] for t in targets):
            raise FleetError(f"--fallback {head}={','.join(targets)}: a chain's models must all be of one kind")
    return specs, chains


def weight_bytes(path: str, cancel: threading.Event | None = None) -> int:
    """Bytes of a model's weights on disk (a GGUF file, or a folder's weight
    files). Blocking (a walk of the folder): call it in a worker; once cancel is
    set it stops at the next folder (DigestCancelled)."""
    if not os.path.isdir(path):
        return os.path.getsize(path)
    total = 0
    for dirpath, _, files in os.walk(path):
        if cancel is not None and cancel.is_set():
            raise DigestCancelled(f"{path}: size walk stopped")
        total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files if f.endswith(WEIGHT_SUFFIXES))
    return total


async def in_worker(work: Callable[[threading.Event], T], timeout: float, what: str) -> T:
    """work(cancel) in a daemon thread; FleetError (400) past timeout seconds.

    Not asyncio.to_thread: a default-executor thread stuck in a read keeps
    the process from exiting (the interpreter joins those threads), and it
    cannot be told to stop. Here cancel is set once nobody waits (timeout,
    cancellation) and the work stops at its next chunk or folder; a daemon
    thread never holds up the exit either way."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()
    cancel = threading.Event()

    def settle(outcome: tuple[bool, Any]) -> None:
        if done.done():
            return
        if outcome[0]:
            done.set_result(outcome[1])
        else:
            done.set_exception(outcome[1])

    def run() -> None:
        outcome: tuple[bool, Any]
        try:
            outcome = (True, work(cancel))
        except BaseException as exc:  # handed to the awaiting task, which decides
            outcome = (False, exc)
        try:
            loop.call_soon_threadsafe(settle, outcome)
        except RuntimeError:  # the loop has closed: nobody waits any more
            pass

    threading.Thread(target=run, name="stoker-model-check", daemon=True).start()
    try:
        return await asyncio.wait_for(done, timeout)
    except TimeoutError:
        raise FleetError(
            f"{what} took longer than --model-check-timeout ({timeout:g} s)", 400, "model_check_timeout"
        ) from None
    finally:
        cancel.set()


def resident_bytes(pid: int) -> int | None:
    """A process's resident memory (Linux /proc), None where unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclass(eq=False)
class ModelVersion:
    """One loaded copy of a model file: an engine process and what the routes need from it."""

    name: str
    number: int
    spec: ModelSpec
    engine: AsyncEngineClient
    make_grammars: Callable[[Any], GrammarChecker]
    """Builds the grammar checker for this version's tokenizer (on its first constrained request)."""
    digest: str | None = None
    """The files' digest, computed at load (whether or not it was pinned)."""
    weight_bytes: int | None = None
    """Its weights on disk, measured at load with the digest."""
    status: VersionStatus = "loading"
    error: str | None = None
    created: float = field(default_factory=time.time)
    ready_at: float | None = None
    holds: int = 0
    """Requests routed to this version that may not have reached its engine
    yet (tokenizing, in admission): a retiring version waits for them too."""
    reasoning_parser: ParserName = "auto"
    """Its --reasoning-parser (docs/reasoning.md)."""
    reasoning: ReasoningMarkers | None = None
    """Its thinking markers under that parser, resolved with its chat tokenizer; None: it does not think."""
    sleep: VersionSleep = field(default_factory=VersionSleep)
    """Whether its engine sleeps (stoker/server/sleep.py): asleep, it still takes requests, which wake it."""
    lora_name: str | None = None
    """The LoRA adapter its requests apply: set on a base version's view for one adapter (stoker.server.lora)."""
    _token_text: dict[int, str] = field(default_factory=dict)
    _grammars: GrammarChecker | None = None

    @property
    def grammars(self) -> GrammarChecker:
        """Checks output constraints compile against this version's tokenizer."""
        if self._grammars is None:
            self._grammars = self.make_grammars(self.tokenizer)
        return self._grammars

    @property
    def label(self) -> str:
        return f"v{self.number}"

    @property
    def kind(self) -> ModelKind:
        return self.spec.kind

    @property
    def pooling(self) -> PoolingEngine | None:
        """A reranker's in-process backend; None for a chat model's engine."""
        return self.engine if isinstance(self.engine, PoolingEngine) else None

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def ready(self) -> bool:
        """It takes requests: its engine runs, or sleeps and wakes for the next one."""
        return self.status in ("serving", "canary") and (self.engine.ready or self.sleep.asleep)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def load_chat_tokenizer(self) -> None:
        """The transformers half of the engine's tokenizer, which an engine may send
        without (it only encodes and decodes; stoker/models/tokenizer.py): the
        routes need it for chat templates, so it loads before the version serves,
        not on a request. Blocking: call it in a thread."""
        tokenizer = self.engine.tokenizer
        if isinstance(tokenizer, Tokenizer):
            _ = tokenizer.hf
            try:  # the thinking markers its template and tokenizer hold: a parser that does not fit stops the load
                self.reasoning = resolve_markers(self.reasoning_parser, tokenizer, self.name)
            except ValueError as exc:
                raise FleetError(str(exc)) from None

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int | None:
        return self.engine.info.model_config.vocab_size if self.engine.info else None

    def token_text(self, token_id: int) -> str:
        """A token's text for logprobs, cached: it never changes for a version."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    def footprint(self) -> int:
        """What the memory budget counts for this version: its weights on disk,
        its KV cache at full use and the engine runtime, or what its process
        holds, if more."""
        info = self.engine.info
        weights = self.weight_bytes or 0  # measured before its engine starts (in a worker, never here)
        if self.pooling is not None:  # a reranker: its float32 arrays in the front end, no runtime of its own
            batcher = self.pooling.batcher
            return batcher.model.parameter_bytes() if batcher is not None else weights
        planned = weights + ENGINE_RUNTIME_BYTES + (info.kv_cache_bytes if info else 0)
        return max(planned, self.memory_bytes() or 0)

    def memory_bytes(self) -> int | None:
        if self.pooling is not None:
            return None  # no process of its own: the front end's size is not its
        info = self.engine.info
        return resident_bytes(info.pid) if info is not None and self.engine.ready else None

    def describe(self) -> dict[str, Any]:
        info = self.engine.info
        return {
            "version": self.label,
            "kind": self.kind,
            "path": os.path.abspath(self.spec.path),
            "digest": self.digest,
            "status": self.status,
            "ready": self.ready,
            "engine_pid": info.pid if info and self.engine.ready else None,
            "engine_restarts": self.engine.restart_count,
            "sleeping": self.sleep.asleep,
            "wakes": self.sleep.wakes,
            "last_wake_seconds": self.sleep.last_wake_seconds,
            "wake_error": self.sleep.wake_error,
            "in_flight": self.engine.num_in_flight,
            "memory_bytes": self.memory_bytes(),
            "max_model_len": info.max_model_len if info else None,
            "kv_capacity_tokens": info.kv_capacity_tokens if info else None,
            "weights": info.weights if info else None,
            "quantized_matmul": info.quantized_matmul if info else None,
            "created": int(self.created),
            "error": self.error,
        }


@dataclass(eq=False)
class ServedModel:
    """A name clients use: its stable version and, during a canary, a second one."""

    name: str
    stable: ModelVersion
    canary: ModelVersion | None = None
    canary_percent: float = 0.0
    loading: ModelVersion | None = None
    """A version being loaded by an admin call (at most one at a time)."""
    base: ServedModel | None = None
    """For a LoRA adapter (stoker.server.lora): the model whose versions serve it, viewed under its name."""
    lora_name: str | None = None
    """For a LoRA adapter: its name, which its requests carry to the engine."""
    _credit: float = 0.0

    def pick(self) -> ModelVersion:
        """The version for a new request. The canary's share is dealt out
        evenly (each request adds the percent to a credit; 100 sends one to
        the canary), so over any N requests it gets its share to within one."""
        canary = self.canary
        if canary is not None and canary.ready:
            self._credit += self.canary_percent  # in percent: whole percents add up exactly
            if self._credit >= 100.0 or not self.stable.ready:
                self._credit = max(0.0, self._credit - 100.0)
                return canary
        return self.stable

    @property
    def available(self) -> bool:
        return self.stable.ready or (self.canary is not None and self.canary.ready)

    def versions(self) -> list[ModelVersion]:
        return [v for v in (self.stable, self.canary, self.loading) if v is not None]


@dataclass(eq=False)
class PendingLoad:
    """An admin load under way: what it waits on now, so that an unload of its
    model or the server's shutdown can end it at once (abort)."""

    name: str
    version: ModelVersion | None = None
    """Set once its engine is being started."""
    step: asyncio.Future[Any] | None = None
    reason: FleetError | None = None

    async def run(self, awaitable: Awaitable[T]) -> T:
        """Await one step of the load; the FleetError abort() gave if it was aborted."""
        if self.reason is not None:
            raise self.reason
        step = asyncio.ensure_future(awaitable)
        self.step = step
        try:
            return await step
        except asyncio.CancelledError:
            step.cancel()
            task = asyncio.current_task()
            if self.reason is not None and not (task is not None and task.cancelling()):
                raise self.reason from None
            raise
        finally:
            self.step = None

    def abort(self, reason: FleetError) -> None:
        if self.reason is None:
            self.reason = reason
        if self.step is not None:
            self.step.cancel()


class Fleet:
    def __init__(
        self,
        specs: list[ModelSpec],
        fallbacks: dict[str, list[str]],
        base_config: EngineConfig,
        make_engine: Callable[[EngineConfig], AsyncEngineClient],
        make_grammars: Callable[[Any], GrammarChecker],
        max_memory: int | None = None,
        make_pooling_engine: Callable[[EngineConfig], AsyncEngineClient] = PoolingEngine,
        drain_timeout: float = 30.0,
        model_roots: Sequence[str] = (),
        max_models: int = 8,
        check_timeout: float = 900.0,
        reasoning_parsers: ParserChoices | None = None,
        sleep_idle: SleepChoices | None = None,
        adapters: Sequence[AdapterSpec] = (),
    ) -> None:
        from stoker.server.lora import Adapters  # lora builds on this module

        check_fallbacks([s.name for s in specs] + [a.name for a in adapters], fallbacks)
        self.base_config = base_config
        self.fallbacks = fallbacks
        self.max_memory = max_memory
        self.drain_timeout = drain_timeout
        self.model_roots = [os.path.realpath(r) for r in model_roots] or default_model_roots(specs)
        """Real paths of the folders the admin API may load from."""
        self.max_models = max_models
        self.check_timeout = check_timeout
        self.reasoning_parsers = reasoning_parsers or ParserChoices()
        self._pending: list[PendingLoad] = []
        self._make_engine = make_engine
        self._make_pooling_engine = make_pooling_engine
        self._make_grammars = make_grammars
        self._numbers: dict[str, int] = {}
        self._initial = [self._new_version(spec) for spec in specs]
        self.models: dict[str, ServedModel] = {}
        self.retiring: list[ModelVersion] = []
        self._lock = asyncio.Lock()  # one admin change at a time
        self._tasks: set[asyncio.Task[None]] = set()
        self.sleep = IdleWatch(self, sleep_idle or SleepChoices(), drain_timeout, self._spawn)
        """Idle sleep and wake of its versions (--sleep-idle-seconds, POST /sleep and /wake_up)."""
        self.adapters = Adapters(self, adapters)
        """Its LoRA adapters (--lora-modules, POST /v1/load_lora_adapter), served as models."""

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """A background task of the fleet's: the shutdown cancels it if it still runs."""
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- versions ------------------------------------------------------------

    def _new_version(self, spec: ModelSpec) -> ModelVersion:
        number = self._numbers.get(spec.name, 0) + 1
        self._numbers[spec.name] = number
        update: dict[str, Any] = {"model": spec.path, "served_model_name": spec.name if spec.named else None}
        config = self.base_config.model_copy(update=update)
        make = self._make_pooling_engine if spec.kind == "rerank" else self._make_engine
        parser = self.reasoning_parsers.for_model(spec.name)
        return ModelVersion(spec.name, number, spec, make(config), self._make_grammars, reasoning_parser=parser)

    async def _measure(self, spec: ModelSpec) -> int:
        """The model's weights on disk, measured in a bounded worker."""
        try:
            return await in_worker(
                lambda cancel: weight_bytes(spec.path, cancel), self.check_timeout, f"model {spec.name}: its size"
            )
        except OSError as exc:
            raise FleetError(f"model {spec.name}: cannot read {spec.path}: {exc}") from None

    async def _load(self, version: ModelVersion, others: list[ModelVersion]) -> None:
        """Digest check, memory check, engine start (the models given at start).
        FleetError (one line) when it cannot serve."""
        spec = version.spec
        size = version.weight_bytes
        if size is None:
            size = version.weight_bytes = await self._measure(spec)
        held = sum(v.footprint() for v in others)
        # Before loading: weights and runtime, a lower bound (the KV cache is known once loaded).
        self._check_memory(spec.name, held, size + ENGINE_RUNTIME_BYTES, size)
        # A pinned file is checked before anything parses it. An unpinned one is
        # hashed while the engine loads: reading every byte takes ~1 s per
        # 1.5 GB, time start-up need not wait for.
        digesting = asyncio.ensure_future(self._digest(version))
        if spec.digest is not None:
            await digesting
        try:
            await version.engine.start()
        except (EngineStartupError, OSError, ValueError) as exc:
            await asyncio.gather(digesting, return_exceptions=True)
            raise FleetError(f"model {spec.name} ({spec.path}): {exc}") from None
        try:
            await digesting
        except FleetError:
            await version.engine.shutdown()
            raise
        try:
            self._check_memory(spec.name, held, version.footprint(), size)
        except FleetError:
            await version.engine.shutdown()
            raise
        version.ready_at = time.time()

    async def _digest(self, version: ModelVersion) -> None:
        """Sets version.digest; FleetError when the files cannot be read or do not match their pin."""
        version.digest = await self._digest_of(version.spec)

    async def _digest_of(self, spec: ModelSpec) -> str:
        """The files' digest, read in a bounded worker; FleetError when they cannot
        be read (in time) or do not match their pin."""
        try:
            digest = await in_worker(
                # A pin is checked against the bytes; otherwise a hash of the same unchanged file is reused.
                lambda cancel: model_digest(spec.path, cancel, reuse=spec.digest is None),
                self.check_timeout,
                f"model {spec.name}: its digest",
            )
        except (OSError, ValueError) as exc:
            raise FleetError(f"model {spec.name}: cannot read {spec.path}: {exc}") from None
        if spec.digest is not None and digest != spec.digest:
            raise FleetError(
                f"model {spec.name}: digest mismatch for {spec.path}: expected {spec.digest}, got {digest}"
            )
        return digest

    def _check_memory(self, name: str, held: int, wanted: int, weights: int) -> None:
        if self.max_memory is not None and held + wanted > self.max_memory:
            raise FleetError(
                f"model {name}: needs about {_mb(wanted)} (weights {_mb(weights)}, KV cache and engine runtime); "
                f"{_mb(held)} of the {_mb(self.max_memory)} --max-model-memory is held by the models loaded",
                409,
                "insufficient_memory",
            )

    async def start(self) -> list[ModelVersion]:
        """Load every model given at start, concurrently. FleetError: nothing serves."""
        # Memory is checked in order, each model against the ones before it: every size first.
        sizes = await asyncio.gather(*(self._measure(v.spec) for v in self._initial), return_exceptions=True)
        for version, size in zip(self._initial, sizes, strict=True):
            if isinstance(size, BaseException):
                raise size if isinstance(size, FleetError) else FleetError(str(size))
            version.weight_bytes = size
        results = await asyncio.gather(
            *(self._load(v, self._initial[:i]) for i, v in enumerate(self._initial)), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(v.engine.shutdown() for v in self._initial), return_exceptions=True)
            first = errors[0]
            if isinstance(first, FleetError):
                raise first
            raise FleetError(str(first)) from first
        for version in self._initial:
            info = version.engine.info
            if not version.spec.named and info is not None and info.model_config.name != version.name:
                version.name = info.model_config.name  # what the engine calls it (a test core, a renamed file)
            if version.name in self.models:
                await asyncio.gather(*(v.engine.shutdown() for v in self._initial), return_exceptions=True)
                raise FleetError(f"two models are named {version.name!r}; name them apart with --model NAME=PATH")
            version.status = "serving"
            self.models[version.name] = ServedModel(version.name, version)
        try:
            await self.adapters.start()  # each on its base's engine, now ready
        except BaseException:
            await asyncio.gather(*(v.engine.shutdown() for v in self._initial), return_exceptions=True)
            raise
        if self.sleep.choices.any:
            self._spawn(self.sleep.run())
        return list(self._initial)

    def versions(self) -> list[ModelVersion]:
        """Every version with an engine: serving, canary, loading and draining ones."""
        found = [v for m in self.models.values() for v in m.versions()] + list(self.retiring)
        # A new model's first version is in no ServedModel while it loads.
        return found + [p.version for p in self._pending if p.version is not None and p.version not in found]

    @property
    def default(self) -> ServedModel:
        return next(iter(self.models.values()))

    @property
    def initial(self) -> list[ModelVersion]:
        return list(self._initial)

    # ---- routing -------------------------------------------------------------

    def names(self) -> list[str]:
        """What requests may name: the models, then the LoRA adapters."""
        return list(self.models) + self.adapters.names()

    def served(self, name: str) -> ServedModel | None:
        """The model, or the adapter (its base's versions viewed under its name), called name."""
        model = self.models.get(name)
        if model is not None:
            return model
        adapter = self.adapters.serving(name)
        base = self.models.get(adapter.base) if adapter is not None else None
        return self.adapters.served(adapter, base) if adapter is not None and base is not None else None

    def resolve(self, name: str | None) -> ServedModel:
        """The model a request names (None: the first one); 404 listing what exists.
        An adapter resolves to its base's versions under its own name, carrying its lora_name."""
        if name is None:
            return self.default
        model = self.served(name)
        if model is None:
            raise APIError(
                404,
                f"The model `{name}` does not exist. Models served here: {_list(self.names())}.",
                param="model",
                code="model_not_found",
            )
        return model

    def chain(self, name: str | None) -> list[ServedModel]:
        """The model and its fallbacks that are currently loaded, in order."""
        first = self.resolve(name)
        rest = [m for m in map(self.served, self.fallbacks.get(first.name, [])) if m is not None]
        return [first, *rest]

    def pick(self, model: ServedModel) -> ModelVersion:
        if model.base is not None and model.lora_name is not None:
            adapter = self.adapters.serving(model.lora_name)
            if adapter is None:  # unloaded since it was resolved
                raise APIError(404, f"The model `{model.name}` does not exist.", param="model", code="model_not_found")
            return self.adapters.view(adapter, model.base.pick())
        return model.pick()

    @staticmethod
    def check_kind(model: ServedModel, kind: ModelKind, endpoint: str) -> None:
        """400 naming the model's kind unless it is kind (a reranker asked to chat, a chat model to rerank)."""
        if model.stable.kind != kind:
            raise APIError(
                400,
                f"model {model.name} is {KIND_WORDS[model.stable.kind]}: it does not serve {endpoint} "
                f"({KIND_ENDPOINTS[model.stable.kind]})",
                param="model",
                code="wrong_model_kind",
            )

    def check_available(self, model: ServedModel) -> None:
        """503 unless the model can take a request now."""
        if not model.available:
            version = model.stable
            if version.status == "loading":
                raise unavailable(f"the model {model.name} is still loading")
            raise unavailable(f"the engine of model {model.name} is restarting; please retry")

    # ---- admin ---------------------------------------------------------------

    async def admit(self, name: str, path: str, digest: str | None) -> ModelSpec:
        """The spec of an admin load: its name and digest well formed, its path
        resolved (symlinks followed) under a model root and a regular file or a
        folder. FleetError saying which is not; checked in a bounded worker (a
        stat on a hung mount must not hang the call)."""
        pinned = checked_pin(digest)
        checked_name(name)
        roots = list(self.model_roots)

        def check(_: threading.Event) -> tuple[str, ModelKind]:
            real = allowed_model_path(path, roots)
            return real, model_kind(real)

        real, kind = await in_worker(check, self.check_timeout, f"model {name}: {path}")
        return ModelSpec(name, real, pinned, kind=kind)

    def _check_room(self, spec: ModelSpec, existing: ServedModel | None) -> None:
        """FleetError unless the admin load may start now."""
        if existing is None and self.max_memory is None and len(self.models) >= self.max_models:
            raise FleetError(
                f"model {spec.name}: {len(self.models)} models are loaded, the most --max-models "
                f"({self.max_models}) allows without --max-model-memory; unload one first",
                409,
                "too_many_models",
            )
        if self._lock.locked() or any(p.version is not None for p in self._pending):
            raise FleetError("another model is loading; try again when it is done", 409, "load_in_progress")

    async def load(self, spec: ModelSpec, canary_percent: float | None = None) -> ModelVersion:
        """Load a new model, or a new version of one beside the old. With
        canary_percent the new version takes that share of new requests (the
        old stays stable); without, it replaces the old, which drains. A
        failure changes nothing that serves (FleetError); so does an unload of
        the model while it loads, or the server's shutdown (the new engine ends)."""
        existing = self.models.get(spec.name)
        if spec.name in self.adapters.adapters:
            raise FleetError(f"model {spec.name}: the name is taken by a LoRA adapter", 409, "name_taken", "name")
        if existing is None and canary_percent is not None:
            raise FleetError(f"model {spec.name} is not loaded: a canary needs a stable version to share traffic with")
        if existing is not None and existing.stable.kind != spec.kind:
            # Its clients call the endpoints of its kind: a new version must serve the same ones.
            raise FleetError(
                f"model {spec.name} is a {existing.stable.kind} model and {spec.path} a {spec.kind} one: "
                "load it under another name",
                409,
                "model_kind_mismatch",
                "path",
            )
        if self.base_config.kv_events_endpoint:
            # A second engine could not bind the endpoint the first one publishes on, and a router
            # reading it would file both engines' blocks under one replica.
            raise FleetError(
                "models cannot be loaded at run time while --kv-events-endpoint is set (one engine publishes "
                "there): restart the server with the model to serve",
                409,
                "kv_events_single_engine",
            )
        self._check_room(spec, existing)
        pending = PendingLoad(spec.name)
        self._pending.append(pending)
        try:
            # The files are read before the lock (bounded, in a worker): a slow
            # or endless read ends this load and never holds up the next one.
            size = await pending.run(self._measure(spec))
            digest = await pending.run(self._digest_of(spec))
            if self.models.get(spec.name) is not existing:
                raise FleetError(f"model {spec.name} changed while its files were read; nothing was loaded", 409)
            self._check_room(spec, existing)
            async with self._lock:
                return await self._start_version(spec, canary_percent, existing, pending, size, digest)
        finally:
            self._pending.remove(pending)

    async def _start_version(
        self,
        spec: ModelSpec,
        canary_percent: float | None,
        existing: ServedModel | None,
        pending: PendingLoad,
        size: int,
        digest: str,
    ) -> ModelVersion:
        version = self._new_version(spec)
        version.weight_bytes, version.digest = size, digest
        pending.version = version
        if existing is not None:
            existing.loading = version
        try:
            held = sum(v.footprint() for v in self.versions() if v is not version)
            self._check_memory(spec.name, held, size + ENGINE_RUNTIME_BYTES, size)
            try:
                await pending.run(version.engine.start())
            except FleetError:  # aborted (an unload, the shutdown): its own answer
                raise
            except (EngineStartupError, OSError, ValueError) as exc:
                raise FleetError(f"model {spec.name} ({spec.path}): {exc}") from None
            self._check_memory(spec.name, held, version.footprint(), size)
            if existing is not None:  # a new version of a base serves its adapters from its first request
                await pending.run(self.adapters.register_on(version))
            await pending.run(asyncio.to_thread(version.load_chat_tokenizer))
            version.ready_at = time.time()
            if self.models.get(spec.name) is not existing:  # unloaded meanwhile (abort() missed no step)
                raise FleetError(
                    f"model {spec.name} was unloaded while {version.label} loaded; nothing was loaded", 409
                )
        except BaseException as exc:  # a cancelled call too: no engine may outlive its load
            version.status, version.error = "failed", str(exc)
            if existing is not None and existing.loading is version:
                existing.loading = None
            # An engine that never became ready holds no request: it ends at once.
            await version.engine.shutdown(timeout=10.0 if version.engine.ready else 0.0)
            raise
        if existing is None:
            version.status = "serving"
            self.models[spec.name] = ServedModel(spec.name, version)
            log.info("model %s %s loaded from %s (%s)", spec.name, version.label, spec.path, version.digest)
            return version
        existing.loading = None
        if canary_percent is not None:
            if existing.canary is not None:
                self._retire(existing.canary)
            version.status = "canary"
            existing.canary, existing.canary_percent = version, canary_percent
            log.info("model %s: canary %s takes %.1f%% (%s)", spec.name, version.label, canary_percent, spec.path)
            return version
        old = [existing.stable, *([existing.canary] if existing.canary else [])]
        version.status = "serving"
        existing.stable, existing.canary, existing.canary_percent = version, None, 0.0
        for v in old:
            self._retire(v)
        log.info("model %s: %s now serves (%s); the old version drains", spec.name, version.label, spec.path)
        return version

    def abort_loads(self, reason: str, status: int = 503, name: str | None = None) -> None:
        """End the admin loads under way (of one model, or all): each answers
        reason and its new engine, if started, ends."""
        for pending in list(self._pending):
            if name is None or pending.name == name:
                pending.abort(FleetError(reason, status, "load_aborted"))

    def promote(self, name: str) -> ModelVersion:
        model = self._model(name)
        if model.canary is None:
            raise FleetError(f"model {name} has no canary to promote", 409)
        old, model.stable = model.stable, model.canary
        model.stable.status = "serving"
        model.canary, model.canary_percent = None, 0.0
        self._retire(old)
        log.info("model %s: canary %s promoted", name, model.stable.label)
        return model.stable

    def rollback(self, name: str) -> ModelVersion:
        model = self._model(name)
        if model.canary is None:
            raise FleetError(f"model {name} has no canary to roll back", 409)
        canary, model.canary, model.canary_percent = model.canary, None, 0.0
        self._retire(canary)
        log.info("model %s: canary %s rolled back", name, canary.label)
        return model.stable

    def set_canary_percent(self, name: str, percent: float) -> None:
        model = self._model(name)
        if model.canary is None:
            raise FleetError(f"model {name} has no canary", 409)
        model.canary_percent = percent

    def unload(self, name: str) -> list[ModelVersion]:
        """Stop routing to a model; its versions drain and end, its adapters
        with them. Fallback chains lose it."""
        model = self._model(name)
        if len(self.models) == 1:
            raise FleetError(f"model {name} is the only model served; load another before unloading it", 409)
        self.forget_fallbacks(name)
        self.adapters.drop_base(name)
        del self.models[name]
        # A new version of it still loading ends too, engine and all.
        self.abort_loads(f"model {name} was unloaded while a new version of it loaded; nothing was loaded", 409, name)
        model.loading = None
        versions = [model.stable, *([model.canary] if model.canary else [])]
        for version in versions:
            self._retire(version)
        log.info("model %s unloaded; its requests in flight finish first", name)
        return versions

    def forget_fallbacks(self, name: str) -> None:
        """Fallback chains lose a model or adapter no longer served."""
        for head, chain in list(self.fallbacks.items()):
            if head == name:
                del self.fallbacks[head]
            elif name in chain:
                chain.remove(name)
                if not chain:
                    del self.fallbacks[head]

    def _model(self, name: str) -> ServedModel:
        model = self.models.get(name)
        if model is None:
            raise APIError(404, f"model {name} is not loaded (models: {_list(self.names())})", code="model_not_found")
        return model

    def _retire(self, version: ModelVersion) -> None:
        version.status = "draining"
        self.retiring.append(version)
        task = asyncio.create_task(self._drain(version))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self, version: ModelVersion) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout
        while (
            version.engine.num_in_flight or version.holds or self.adapters.holds_on(version)
        ) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if version.engine.num_in_flight:
            log.warning(
                "model %s %s: drain timeout, aborting %d", version.name, version.label, version.engine.num_in_flight
            )
            version.engine.abort_all_soft()
            await asyncio.sleep(1.0)
        await version.engine.shutdown()
        version.status = "unloaded"
        self.retiring.remove(version)

    async def shutdown(self) -> None:
        self.abort_loads("the server is shutting down")
        self.adapters.shutdown()
        for task in list(self._tasks):
            task.cancel()
        engines = {id(v.engine): v.engine for v in [*self._initial, *self.versions()]}
        await asyncio.gather(*(e.shutdown() for e in engines.values()), return_exceptions=True)

    def describe(self) -> list[dict[str, Any]]:
        out = []
        for model in self.models.values():
            out.append(
                {
                    "name": model.name,
                    "stable": model.stable.describe(),
                    "canary": model.canary.describe() if model.canary else None,
                    "canary_percent": model.canary_percent,
                    "loading": model.loading.describe() if model.loading else None,
                    "fallbacks": list(self.fallbacks.get(model.name, [])),
                    "adapters": self.adapters.describe(model.name),
                }
            )
        return out


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB"

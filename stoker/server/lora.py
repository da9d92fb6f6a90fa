"""LoRA adapters served as models: each one a name clients send in `model`,
applied by its base model's engine to that request's rows alone.

    stoker serve base.gguf --lora-modules sql=/a/sql@sha256:... --lora-modules chat=/a/chat-lora.gguf
    stoker serve --model big=/m/big.gguf --model small=/m/small.gguf --lora-modules big:sql=/a/sql

An adapter is registered with every engine of its base (its stable version,
a canary, a version loading for a hot swap) before a request can name it.
Requests for it travel as the base's requests do, through a *view* of the
base's version: the same engine, tokenizer and grammars under the adapter's
name, so keys' allow-lists, limits, budgets, the ledger and metrics see the
adapter's name, and the engine request carries `lora_name`.

Unloading stops routing at once (404 for new requests), lets the requests
in flight finish (routed, tokenizing, or in the engine), then removes the
adapter from the engines; an adapter of a model unloaded goes with it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from stoker.engine.client import AsyncEngineClient, EngineUnavailableError, LoraRejectedError
from stoker.engine.params import LoraInfo
from stoker.errors import APIError
from stoker.models.digest import model_digest
from stoker.server.fleet import (
    Fleet,
    FleetError,
    ModelSpec,
    ModelVersion,
    ServedModel,
    allowed_model_path,
    check_model_file,
    checked_name,
    checked_pin,
    in_worker,
)

log = logging.getLogger("stoker.server")

LORA_FORM = "[BASE:]NAME=PATH[@sha256:DIGEST]"

AdapterStatus = Literal["loading", "serving", "draining"]


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    base: str
    """The model whose engines apply it."""
    path: str
    """A PEFT folder (adapter_config.json + adapter_model.safetensors) or a llama.cpp GGUF LoRA file."""
    digest: str | None = None
    """"sha256:<hex>" its files must have (adapter_digest), or None: not pinned."""


def parse_lora_module(text: str, models: Sequence[str]) -> AdapterSpec:
    """[BASE:]NAME=PATH[@sha256:HEX] (BASE: one of models; left out, the only
    one). FleetError, in one line naming the entry, if malformed."""
    entry = text.strip()
    left, sep, rest = entry.partition("=")
    try:
        if not sep or not left or not rest:
            raise FleetError(f"expected {LORA_FORM}")
        base, name = _split_base(left, models)
        path, at, digest = rest.rpartition("@sha256:")
        if not at:
            path = rest
        pinned = checked_pin("sha256:" + digest if at else None)
        checked_name(name)
        check_model_file(path)
    except FleetError as exc:
        raise FleetError(f"--lora-modules {entry!r}: {exc}".replace("no model at", "no adapter at")) from None
    return AdapterSpec(name, base, path, pinned)


def _split_base(left: str, models: Sequence[str]) -> tuple[str, str]:
    """(base, name) of `[BASE:]NAME`: a model name may itself hold ':', so the
    base is the first prefix before a ':' that names a model."""
    for at, char in enumerate(left):
        if char == ":" and left[:at] in models:
            return left[:at], left[at + 1 :]
    if len(models) != 1:
        raise FleetError(f"name the adapter's base model, one of {', '.join(models)} ({LORA_FORM})")
    return models[0], left


def plan_adapters(entries: Sequence[str], specs: Sequence[ModelSpec]) -> list[AdapterSpec]:
    """The adapters --lora-modules asks for; FleetError (one line) on a bad
    entry, a base that is not a chat model, or a name already taken."""
    models = [s.name for s in specs]
    kinds = {s.name: s.kind for s in specs}
    adapters: list[AdapterSpec] = []
    for text in entries:
        spec = parse_lora_module(text, models)
        if kinds[spec.base] != "generate":
            raise FleetError(
                f"--lora-modules {text.strip()!r}: model {spec.base} is a reranker; adapters apply to chat models"
            )
        if spec.name in models or any(a.name == spec.name for a in adapters):
            raise FleetError(
                f"--lora-modules {text.strip()!r}: the name {spec.name!r} is taken by another model or adapter"
            )
        adapters.append(spec)
    return adapters


def _reason(name: str, message: str) -> str:
    """The engine's refusal without its own naming of the adapter (the caller names it once)."""
    for prefix in (f"LoRA adapter {name!r}: ", f"adapter {name}: "):
        if message.startswith(prefix):
            return message[len(prefix) :]
    return message


def adapter_digest(path: str, cancel: threading.Event | None = None) -> str:
    """ "sha256:<hex>" of a GGUF LoRA file (`sha256sum FILE`), or of a PEFT folder the way a model
    folder's is taken (stoker/models/digest.py): its adapter_config.json counts, since its alpha,
    rank and target settings change the arithmetic as much as the weights do."""
    return model_digest(path, cancel)


@dataclass(eq=False)
class ServedAdapter:
    spec: AdapterSpec
    digest: str | None = None
    """Its digest, computed as it registers (whether or not it was pinned)."""
    info: LoraInfo | None = None
    """What its base's engine found in it (rank, target modules, bytes)."""
    status: AdapterStatus = "loading"
    created: float = field(default_factory=time.time)
    views: dict[ModelVersion, ModelVersion] = field(default_factory=dict)
    """Each base version as this adapter's requests see it (ModelVersion.lora_name set)."""

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def base(self) -> str:
        return self.spec.base

    def describe(self, in_flight: int) -> dict[str, Any]:
        info = self.info
        return {
            "name": self.name,
            "base": self.base,
            "path": os.path.abspath(self.spec.path),
            "digest": self.digest,
            "status": self.status,
            "rank": info.rank if info else None,
            "target_modules": list(info.target_modules) if info else None,
            "memory_bytes": info.nbytes if info else None,
            "in_flight": in_flight,
            "created": int(self.created),
        }


class Adapters:
    """The fleet's adapters: registration on the base's engines, routing, drain."""

    def __init__(self, fleet: Fleet, specs: Sequence[AdapterSpec] = ()) -> None:
        self.fleet = fleet
        self.configured = list(specs)
        """The adapters given at start (--lora-modules), registered once their bases serve."""
        self.adapters: dict[str, ServedAdapter] = {}
        self.in_flight: collections.Counter[str] = collections.Counter()
        """Engine requests in flight by adapter name (serving.job.run_job counts them)."""
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- routing ---------------------------------------------------------------

    def serving(self, name: str) -> ServedAdapter | None:
        adapter = self.adapters.get(name)
        return adapter if adapter is not None and adapter.status == "serving" else None

    def names(self) -> list[str]:
        return [a.name for a in self.adapters.values() if a.status == "serving"]

    def base_of(self, name: str) -> str | None:
        """The base model of an adapter called name; None for any other name."""
        adapter = self.adapters.get(name)
        return adapter.base if adapter is not None else None

    def of_base(self, base: str) -> list[ServedAdapter]:
        return [a for a in self.adapters.values() if a.base == base]

    def served(self, adapter: ServedAdapter, base: ServedModel) -> ServedModel:
        """The adapter as a model routes see it: its base's versions, viewed."""
        canary = self.view(adapter, base.canary) if base.canary is not None else None
        return ServedModel(
            adapter.name,
            self.view(adapter, base.stable),
            canary,
            base.canary_percent,
            base=base,
            lora_name=adapter.name,
        )

    def view(self, adapter: ServedAdapter, version: ModelVersion) -> ModelVersion:
        """version as adapter's requests see it: its engine, tokenizer and
        grammars under the adapter's name, with its status at this moment."""
        view = adapter.views.get(version)
        if view is None:
            for old in [v for v in adapter.views if v.status == "unloaded"]:
                del adapter.views[old]
            view = dataclasses.replace(
                version, name=adapter.name, lora_name=adapter.name, make_grammars=lambda _: version.grammars, holds=0
            )
            adapter.views[version] = view
        view.status, view.ready_at, view.reasoning = version.status, version.ready_at, version.reasoning
        return view

    def holds_on(self, version: ModelVersion) -> int:
        """Requests routed to version through an adapter and not yet in its engine."""
        return sum(view.holds for a in self.adapters.values() for v, view in a.views.items() if v is version)

    # ---- registration ------------------------------------------------------------

    async def start(self) -> None:
        """Register the adapters given at start, each on its base's engine.
        FleetError "adapter NAME: REASON" for the first that is refused."""
        models = list(self.fleet.models)
        for spec in self.configured:
            if spec.base not in self.fleet.models and len(models) == 1:
                spec = dataclasses.replace(spec, base=models[0])  # the only model, renamed by its engine
            await self.add(spec)

    async def admit(self, name: str, path: str, digest: str | None, base: str | None) -> AdapterSpec:
        """The spec of an adapter loaded at run time: its name and digest well
        formed, its base served (None: the first model), its path resolved under
        a --model-root as a model's is (403 outside). FleetError naming the adapter."""
        fleet = self.fleet
        pinned = checked_pin(digest)
        checked_name(name)
        base_name = base if base is not None else fleet.default.name
        if base_name not in fleet.models:
            raise FleetError(
                f"adapter {name}: no model {base_name} to apply it to (models: {', '.join(fleet.models)})",
                400,
                "model_not_found",
                "base_model_name",
            )
        roots = list(fleet.model_roots)
        try:
            real = await in_worker(lambda _: allowed_model_path(path, roots), fleet.check_timeout, f"adapter {name}")
        except FleetError as exc:
            message = str(exc).replace("no model at", "no adapter at")
            raise FleetError(f"adapter {name}: {message}", exc.status, exc.code, "lora_path") from None
        return AdapterSpec(name, base_name, real, pinned)

    async def add(self, spec: AdapterSpec) -> ServedAdapter:
        """Check the adapter's digest, register it with every engine of its base,
        then route to it. FleetError naming the adapter and the reason: a bad
        file (the engine's LoraError), a digest mismatch, a name taken."""
        fleet = self.fleet
        if spec.name in fleet.models or spec.name in self.adapters:
            taken = "a model" if spec.name in fleet.models else "an adapter"
            raise FleetError(f"adapter {spec.name}: the name is taken by {taken}", 400, "name_taken", "lora_name")
        base = fleet.models.get(spec.base)
        if base is None:
            raise FleetError(f"adapter {spec.name}: no model {spec.base} to apply it to", 400, "model_not_found")
        if base.stable.kind != "generate":
            raise FleetError(f"adapter {spec.name}: model {spec.base} is a reranker; adapters apply to chat models")
        if base.loading is not None:  # its new engine takes the adapters registered when it is ready, not this one
            raise FleetError(
                f"adapter {spec.name}: model {spec.base} is loading a new version; try again when it is done",
                409,
                "load_in_progress",
            )
        adapter = ServedAdapter(spec)
        self.adapters[spec.name] = adapter  # holds the name while it loads; routes only once serving
        try:
            try:
                adapter.digest = await in_worker(
                    lambda cancel: adapter_digest(spec.path, cancel), fleet.check_timeout, f"adapter {spec.name}"
                )
            except (FileNotFoundError, ValueError):  # ValueError: a folder with no weight or config file
                if spec.digest is not None or not os.path.isdir(spec.path):
                    raise FleetError(f"adapter {spec.name}: no {spec.path} to read its digest from") from None
                # A folder without adapter_model.safetensors (.bin weights, a wrong folder): the engine says why.
            except OSError as exc:
                raise FleetError(f"adapter {spec.name}: cannot read {spec.path}: {exc}") from None
            if spec.digest is not None and adapter.digest != spec.digest:
                raise FleetError(
                    f"adapter {spec.name}: digest mismatch for {spec.path}: expected {spec.digest}, got {adapter.digest}"
                )
            for version in base.versions():
                await fleet.sleep.wake(version)  # a sleeping base wakes: its engine checks the adapter
            engines = [v.engine for v in base.versions()]
            adapter.info = await self._register(spec, engines)
        except BaseException:
            del self.adapters[spec.name]
            raise
        adapter.status = "serving"
        log.info("adapter %s of %s registered from %s (%s)", spec.name, spec.base, spec.path, adapter.digest)
        return adapter

    async def _register(self, spec: AdapterSpec, engines: list[AsyncEngineClient]) -> LoraInfo:
        """add_lora on each engine; on a refusal, the ones that took it drop it again."""
        done: list[AsyncEngineClient] = []
        info: LoraInfo | None = None
        try:
            for engine in engines:
                info = await engine.add_lora(spec.name, spec.path)
                done.append(engine)
        except BaseException as exc:
            await asyncio.gather(*(e.remove_lora(spec.name) for e in done), return_exceptions=True)
            if isinstance(exc, (LoraRejectedError, EngineUnavailableError)):
                raise FleetError(f"adapter {spec.name}: {_reason(spec.name, str(exc))}") from None
            raise
        assert info is not None, "a base model has at least one engine"
        return info

    async def register_on(self, version: ModelVersion) -> None:
        """A new version of a base (a hot swap, a canary) takes its adapters
        before it serves; FleetError if one is refused (the load fails)."""
        for adapter in self.of_base(version.name):
            if adapter.status == "serving":
                await self._register(adapter.spec, [version.engine])

    def remove(self, name: str) -> ServedAdapter:
        """Stop routing to an adapter now; it leaves its engines once its
        requests in flight have finished (in the background)."""
        adapter = self.adapters.get(name)
        if adapter is None or adapter.status != "serving":
            state = "" if adapter is None else f" (it is {adapter.status})"
            raise APIError(404, f"adapter {name} is not loaded{state}", code="lora_not_found", param="lora_name")
        adapter.status = "draining"
        self.fleet.forget_fallbacks(name)
        task = asyncio.create_task(self._drain(adapter))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        log.info("adapter %s unloaded; its requests in flight finish first", name)
        return adapter

    def drop_base(self, base: str) -> None:
        """A base unloaded: its adapters go with its engines."""
        for adapter in self.of_base(base):
            if adapter.status == "serving":
                self.remove(adapter.name)

    def busy(self, adapter: ServedAdapter) -> int:
        return self.in_flight[adapter.name] + sum(view.holds for view in adapter.views.values())

    async def _drain(self, adapter: ServedAdapter) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.fleet.drain_timeout
        while self.busy(adapter) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.busy(adapter):
            log.warning("adapter %s: drain timeout with %d requests in flight", adapter.name, self.busy(adapter))
        base = self.fleet.models.get(adapter.base)
        engines = [v.engine for v in base.versions()] if base is not None else []
        try:
            # Every engine, a sleeping or restarting one too: its client forgets the adapter, so no later start
            # registers it again.
            await asyncio.gather(*(e.remove_lora(adapter.name) for e in engines), return_exceptions=True)
        finally:
            if self.adapters.get(adapter.name) is adapter:
                del self.adapters[adapter.name]
                self.in_flight.pop(adapter.name, None)

    def describe(self, base: str) -> list[dict[str, Any]]:
        return [a.describe(self.busy(a)) for a in self.of_base(base)]

    def shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()

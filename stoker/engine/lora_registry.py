"""LoRA adapters in the engine: which are registered (name -> file), which are
in memory, and the loads that move them there.

Every file read happens on one loader thread, so a step never waits on a
disk: a registration answers once its load is done (the process loop
collects it between steps), and a request whose adapter was dropped from
memory waits in the queue while the loader reads it again. At most
max_loaded adapters are resident or loading; beyond that the least recently
used one that no running request uses is dropped (RAM only: its
registration stays, and the next request naming it loads it again).

Each resident adapter carries the root of its requests' prefix-cache hash
chains: a digest of its name and of its files' bytes, so requests of
different adapters (or of the base, whose chains start from None) never
share KV blocks, and a file replaced under the same name never meets the
blocks its predecessor computed, in RAM or on the disk tier.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from stoker.config import ModelConfig
from stoker.engine.params import LoraAnswer, LoraInfo
from stoker.models.lora import LoraAdapter, LoraError, load_lora

log = logging.getLogger("stoker.engine.lora")

MAX_NAME_CHARS = 256
"""Longest adapter name accepted (a served model name, in URLs and metric labels)."""
RECENT_LOADS = 64
"""Load durations kept for the metrics poller."""

Loader = Callable[[str, str, ModelConfig, int], LoraAdapter]


@dataclass(frozen=True)
class Resident:
    adapter: LoraAdapter
    hash_root: bytes
    """Where its requests' prefix-cache hash chains start."""


def info_of(adapter: LoraAdapter) -> LoraInfo:
    return LoraInfo(
        adapter.name, adapter.path, adapter.rank, tuple(sorted(adapter.target_modules)), int(adapter.nbytes)
    )


def files_digest(path: str) -> bytes:
    """sha256 of an adapter's bytes: the file, or a folder's top-level files in name order."""
    digest = hashlib.sha256()
    root = Path(path)
    files = sorted(p for p in root.iterdir() if p.is_file()) if root.is_dir() else [root]
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with file.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.digest()


def hash_root(name: str, content_digest: bytes) -> bytes:
    return hashlib.sha256(b"stoker-lora\0" + name.encode() + b"\0" + content_digest).digest()


@dataclass
class _Registration:
    ticket: int
    name: str
    path: str
    future: Future[Resident]


class LoraRegistry:
    def __init__(self, model_config: ModelConfig, max_rank: int, max_loaded: int, loader: Loader = load_lora) -> None:
        self.model_config = model_config
        self.max_rank = max_rank
        self.max_loaded = max_loaded
        self._loader = loader
        self.paths: dict[str, str] = {}
        """Registered adapters: name -> file or folder, in registration order."""
        self._resident: OrderedDict[str, Resident] = OrderedDict()
        """In memory, least recently used first."""
        self._loads: dict[str, Future[Resident]] = {}
        """Reloads of registered adapters in flight."""
        self._registrations: list[_Registration] = []
        self._answers: list[LoraAnswer] = []
        self._failures: list[tuple[str, str]] = []
        self._executor: ThreadPoolExecutor | None = None
        self.num_loads = 0
        self.num_load_failures = 0
        self.num_evictions = 0
        self.load_seconds: deque[float] = deque(maxlen=RECENT_LOADS)

    # ------------------------------------------------------------ registry

    def register(self, ticket: int, name: str, path: str) -> None:
        """Start loading and validating an adapter; its answer comes from take_answers once loaded."""
        error = self._refusal(name, path)
        if error is not None:
            self._answers.append(LoraAnswer(ticket, error=error))
            return
        if self.paths.get(name) == path:
            resident = self._resident.get(name)
            if resident is not None:  # registered again as it is (a client re-registering): nothing to read
                self._answers.append(LoraAnswer(ticket, info_of(resident.adapter)))
                return
        future = self._submit(name, path)
        self._registrations.append(_Registration(ticket, name, path, future))

    def _refusal(self, name: str, path: str) -> str | None:
        if not name or len(name) > MAX_NAME_CHARS or not name.isprintable() or name != name.strip():
            return f"LoRA adapter name {name[:MAX_NAME_CHARS]!r}: 1 to {MAX_NAME_CHARS} printable characters, no surrounding spaces"
        registered = self.paths.get(name)
        if registered is not None and registered != path:
            return f"LoRA adapter {name!r} is already registered from {registered}; remove it first"
        if any(r.name == name for r in self._registrations):
            return f"LoRA adapter {name!r} is being registered already"
        return None

    def remove(self, name: str) -> bool:
        """Forget an adapter (its memory too); False if it was not registered."""
        for registration in [r for r in self._registrations if r.name == name]:
            self._registrations.remove(registration)
            registration.future.cancel()
            self._answers.append(
                LoraAnswer(registration.ticket, error=f"LoRA adapter {name!r} was removed while loading")
            )
        self._loads.pop(name, None)  # a reload still running finishes unread
        self._resident.pop(name, None)
        return self.paths.pop(name, None) is not None

    def is_registered(self, name: str) -> bool:
        return name in self.paths

    # ------------------------------------------------------------ memory

    def resident(self, name: str) -> Resident | None:
        return self._resident.get(name)

    def ensure(self, name: str, in_use: set[str]) -> Resident | None:
        """The adapter if resident (now the most recently used); else start its load, when there
        is room for it beside the adapters in use, and return None: the request waits."""
        resident = self._resident.get(name)
        if resident is not None:
            self._resident.move_to_end(name)
            return resident
        if name in self._loads or name not in self.paths:
            return None
        self._evict(self.max_loaded - 1, in_use)
        if len(self._resident) + self._in_flight() < self.max_loaded:
            self._loads[name] = self._submit(name, self.paths[name])
        return None

    def _in_flight(self) -> int:
        return len(self._loads) + len(self._registrations)

    def _evict(self, keep: int, in_use: set[str]) -> None:
        """Drop least recently used adapters not in use until at most `keep` are resident or loading."""
        for name in list(self._resident):
            if len(self._resident) + self._in_flight() <= keep:
                return
            if name not in in_use:
                del self._resident[name]
                self.num_evictions += 1
                log.info("LoRA adapter %s dropped from memory (--max-loaded-loras %d)", name, self.max_loaded)

    def _submit(self, name: str, path: str) -> Future[Resident]:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stoker-lora")
        return self._executor.submit(self._load, name, path)

    def _load(self, name: str, path: str) -> Resident:
        """On the loader thread: digest and load the files (LoraError names what is wrong)."""
        started = time.perf_counter()
        try:
            digest = files_digest(path)
        except OSError as exc:
            raise LoraError.of(name, f"cannot read {path}: {exc.strerror or exc}") from None
        adapter = self._loader(name, path, self.model_config, self.max_rank)
        self.load_seconds.append(time.perf_counter() - started)
        return Resident(adapter, hash_root(name, digest))

    # ------------------------------------------------------------ between steps

    def poll(self, in_use: set[str]) -> None:
        """Collect finished loads: registrations answered, reloads made resident, failures noted."""
        for registration in [r for r in self._registrations if r.future.done()]:
            self._registrations.remove(registration)
            resident, error = self._outcome(registration.name, registration.future)
            if resident is None:
                self._answers.append(LoraAnswer(registration.ticket, error=error))
                continue
            self.paths[registration.name] = registration.path
            self._resident[registration.name] = resident
            self._answers.append(LoraAnswer(registration.ticket, info_of(resident.adapter)))
            log.info("LoRA adapter %s registered from %s", registration.name, registration.path)
        for name, future in [(n, f) for n, f in self._loads.items() if f.done()]:
            del self._loads[name]
            resident, error = self._outcome(name, future)
            if resident is None:
                self._failures.append((name, error or "failed to load"))
            elif name in self.paths:
                self._resident[name] = resident
        self._evict(self.max_loaded, in_use)

    def _outcome(self, name: str, future: Future[Resident]) -> tuple[Resident | None, str | None]:
        try:
            resident = future.result()
        except LoraError as exc:
            self.num_load_failures += 1
            log.warning("%s", exc)
            return None, " ".join(str(exc).split())
        except Exception as exc:  # a loader bug must not take the engine down: the adapter is refused
            self.num_load_failures += 1
            log.exception("LoRA adapter %s: loading failed", name)
            return None, f"LoRA adapter {name!r}: loading failed: {type(exc).__name__}: {exc}"
        self.num_loads += 1
        return resident, None

    @property
    def pending(self) -> bool:
        """Loads in flight, or failures not yet taken: the step loop has something to collect."""
        return bool(self._loads or self._registrations or self._failures)

    @property
    def busy(self) -> bool:
        """Loads in flight (the process loop polls sooner while they run)."""
        return bool(self._loads or self._registrations)

    def wait(self, timeout: float) -> None:
        """An otherwise idle step: wait a little for a load rather than spin."""
        futures = [*self._loads.values(), *(r.future for r in self._registrations)]
        if futures:
            wait(futures, timeout, FIRST_COMPLETED)

    def answer(self, answer: LoraAnswer) -> None:
        self._answers.append(answer)

    def take_answers(self) -> list[LoraAnswer]:
        answers, self._answers = self._answers, []
        return answers

    def take_failures(self) -> list[tuple[str, str]]:
        """(name, message) of reloads that failed since the last call: their waiting requests fail."""
        failures, self._failures = self._failures, []
        return failures

    @property
    def num_resident(self) -> int:
        return len(self._resident)

    @property
    def resident_bytes(self) -> int:
        return sum(int(r.adapter.nbytes) for r in self._resident.values())

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

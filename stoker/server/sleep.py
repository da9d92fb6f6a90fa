"""Idle sleep: a fleet model nobody asks for gives its memory back.

    stoker serve --model big=/m/big.gguf --model small=/m/small.gguf --sleep-idle-seconds big=600

A model version idle for --sleep-idle-seconds (no request in flight, none
routed to it, none arriving) falls asleep: its engine process exits cleanly,
so its weights and KV cache leave memory (the disk tier keeps its files);
the fleet keeps the version (name, digest, config, adapters) and it still
counts as ready: /ready stays 200. The next request routed to it wakes it
and waits for the new engine (bounded by its deadline and the engine's
start-up timeout); the requests that arrive meanwhile share that one wake.
Operators put a model to sleep and wake it with POST /sleep, /wake_up
(stoker/server/routes/sleep.py).

Sleep never races a request. The gate (wake_for) is where a routed request
meets its version's engine. Once a version starts falling asleep the gate
is shut: requests arriving then wait at it while the version drains (those
past the gate finish first), the engine stops, and the first waiter wakes
it again at once. A version waits for its requests past the gate by
counting: its holds (requests routed to it) less those waiting at the gate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stoker.errors import APIError

if TYPE_CHECKING:
    from stoker.server.fleet import Fleet, ModelVersion

log = logging.getLogger("stoker.server")

MAX_IDLE_SECONDS = 366 * 86400
"""The longest --sleep-idle-seconds: a year (0 is never)."""
UNREPORTED_WAKES = 64
"""Wake durations a version keeps until the metrics feed takes them (every 0.25 s)."""
SLEEP_STATUSES = ("serving", "canary")
"""The versions that may sleep: a loading one has not served yet, a draining one ends anyway."""
WAKE_RETRY_AFTER = 5
"""Seconds a client is told to wait after a wake failed (a 503): a restart of the engine takes about that."""

Spawn = Callable[[Coroutine[Any, Any, None]], "asyncio.Task[None]"]
"""Starts one of the fleet's background tasks (the fleet's shutdown cancels those still running)."""


@dataclass(frozen=True)
class SleepChoices:
    """--sleep-idle-seconds: seconds for every model, and per model by name; 0 never sleeps."""

    default: float = 0.0
    per_model: dict[str, float] = field(default_factory=dict)

    def for_model(self, name: str) -> float:
        return self.per_model.get(name, self.default)

    @property
    def any(self) -> bool:
        return self.default > 0 or any(s > 0 for s in self.per_model.values())


def parse_sleep_choices(entries: Sequence[str]) -> SleepChoices:
    """N (every model) or NAME=N entries; ValueError naming the bad one."""
    default = 0.0
    per_model: dict[str, float] = {}
    for entry in entries:
        name, _, text = entry.rpartition("=")
        try:
            seconds = float(text)
        except ValueError:
            seconds = -1.0
        if not 0 <= seconds <= MAX_IDLE_SECONDS:  # NaN fails too
            raise ValueError(
                f"--sleep-idle-seconds {entry!r}: expected N or NAME=N, N seconds from 0 (never) to {MAX_IDLE_SECONDS}"
            )
        if not name and "=" in entry:
            raise ValueError(f"--sleep-idle-seconds {entry!r}: no model name before '='")
        if name:
            per_model[name] = seconds
        else:
            default = seconds
    return SleepChoices(default, per_model)


def check_sleep_names(choices: SleepChoices, names: Sequence[str]) -> None:
    """ValueError for a per-model entry naming no model given at start."""
    unknown = sorted(set(choices.per_model) - set(names))
    if unknown:
        raise ValueError(
            f"--sleep-idle-seconds names {', '.join(unknown)}, which is not a model given at start "
            f"(models: {', '.join(names)})"
        )


@dataclass(eq=False)
class VersionSleep:
    """One model version's sleep: whether its engine is down by choice, and the
    one sleep or wake under way (every caller awaits that one)."""

    asleep: bool = False
    """True from the moment it starts falling asleep until a wake has finished."""
    last_active: float = field(default_factory=time.monotonic)
    """When a request last passed the gate or the idle watch last saw it busy."""
    waiting: int = 0
    """Requests waiting at the gate for a sleep or a wake to end."""
    wake_error: str | None = None
    """Why the latest wake failed; None once one succeeds."""
    wakes: int = 0
    last_wake_seconds: float | None = None
    unreported_wakes: list[float] = field(default_factory=list)
    """Wake durations, seconds, the metrics feed has not taken yet (at most UNREPORTED_WAKES)."""
    transition: asyncio.Task[None] | None = None
    waking: bool = False
    """Whether transition is a wake (else a sleep)."""

    def take_wakes(self) -> list[float]:
        """The wake durations since the last call (the one consumer: the metrics feed)."""
        taken, self.unreported_wakes = self.unreported_wakes, []
        return taken


Holds = Callable[["ModelVersion"], int]
"""Requests routed to a version and not yet done with it, through its adapters' views too."""


def is_idle(version: ModelVersion, holds: Holds) -> bool:
    """Nothing routed to it is in its engine or on the way there (the gate's waiters aside)."""
    return version.engine.num_in_flight == 0 and holds(version) <= version.sleep.waiting


def begin_sleep(version: ModelVersion, drain_timeout: float, holds: Holds, spawn: Spawn) -> asyncio.Task[None] | None:
    """Start putting the version to sleep: shut the gate, then (in the task
    returned) let what is past it finish, up to drain_timeout, then abort it
    as a drain does, and stop the engine. None when it cannot sleep now (not
    serving, its engine down, asleep already)."""
    sleep = version.sleep
    if sleep.asleep or version.status not in SLEEP_STATUSES or not version.engine.ready:
        return None
    sleep.asleep, sleep.waking = True, False
    task = spawn(_sleep(version, drain_timeout, holds))
    sleep.transition = task
    return task


async def _sleep(version: ModelVersion, drain_timeout: float, holds: Holds) -> None:
    sleep = version.sleep
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout
        while not is_idle(version, holds) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if version.engine.num_in_flight:
            log.warning(
                "model %s %s: drain before sleep timed out, aborting %d",
                version.name,
                version.label,
                version.engine.num_in_flight,
            )
            version.engine.abort_all_soft()
            grace = loop.time() + 1.0
            while version.engine.num_in_flight and loop.time() < grace:
                await asyncio.sleep(0.02)
        await version.engine.sleep()
        log.info("model %s %s is asleep (its engine process ended)", version.name, version.label)
    finally:
        sleep.transition = None


async def wake_for(version: ModelVersion, deadline: float | None, spawn: Spawn) -> None:
    """The gate: return once the version's engine runs, waking it if it sleeps.
    Waits for a sleep under way first. deadline is the request's (time.time());
    past it a 504. A wake that fails is a 503 with Retry-After."""
    sleep = version.sleep
    sleep.last_active = time.monotonic()
    if not sleep.asleep:
        return
    sleep.waiting += 1
    try:
        while sleep.asleep:
            if sleep.transition is None:
                sleep.waking = True
                sleep.transition = spawn(_wake(version))
            waking = sleep.waking
            await _bounded(sleep.transition, deadline, version.name)
            if waking and sleep.asleep:  # the wake this request waited for failed
                raise APIError(
                    503,
                    f"model {version.name} was asleep and could not be woken: {sleep.wake_error}",
                    type="service_unavailable",
                    code="wake_failed",
                    retry_after=WAKE_RETRY_AFTER,
                )
    finally:
        sleep.waiting -= 1
        sleep.last_active = time.monotonic()


async def _bounded(task: asyncio.Task[None], deadline: float | None, model: str) -> None:
    """Await the shared task (never cancelling it) until the request's deadline."""
    timeout = None if deadline is None else max(0.0, deadline - time.time())
    try:
        await asyncio.wait_for(asyncio.shield(task), timeout)
    except TimeoutError:
        raise APIError(
            504,
            f"The request's deadline passed while its model {model} woke from sleep.",
            type="timeout",
            code="deadline_exceeded",
        ) from None
    except asyncio.CancelledError:
        if task.cancelled() and not _cancelling():  # the server is shutting down, this request is not cancelled
            raise APIError(503, "the server is shutting down", type="service_unavailable", code="draining") from None
        raise


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def _wake(version: ModelVersion) -> None:
    sleep = version.sleep
    started = time.monotonic()
    try:
        await version.engine.wake()
    except (RuntimeError, OSError, ValueError) as exc:  # EngineStartupError is a RuntimeError
        sleep.wake_error = str(exc) or type(exc).__name__
        log.error("model %s %s did not wake: %s", version.name, version.label, sleep.wake_error)
        return
    finally:
        sleep.transition = None
    seconds = time.monotonic() - started
    sleep.asleep, sleep.wake_error = False, None
    sleep.wakes += 1
    sleep.last_wake_seconds = seconds
    sleep.unreported_wakes = [*sleep.unreported_wakes[-(UNREPORTED_WAKES - 1) :], seconds]
    sleep.last_active = time.monotonic()
    log.info("model %s %s woke in %.2f s", version.name, version.label, seconds)


class IdleWatch:
    """Puts each version to sleep once it has been idle for its model's
    --sleep-idle-seconds, and answers the gate and the operators' calls."""

    def __init__(self, fleet: Fleet, choices: SleepChoices, drain_timeout: float, spawn: Spawn) -> None:
        self.fleet = fleet
        self.choices = choices
        self.drain_timeout = drain_timeout
        self.spawn = spawn

    @property
    def tick(self) -> float:
        """How often idleness is checked: a tenth of the shortest idle time, from 0.05 s to 1 s."""
        times = [s for s in [self.choices.default, *self.choices.per_model.values()] if s > 0]
        return min(1.0, max(0.05, min(times, default=10.0) / 10))

    def holds(self, version: ModelVersion) -> int:
        """Its own holds and those of its adapters' views (each view counts its requests apart)."""
        return version.holds + self.fleet.adapters.holds_on(version)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.tick)
            try:
                self.check(time.monotonic())
            except Exception:  # the watch outlives one bad round: a model that never sleeps costs only memory
                log.exception("idle sleep: checking the models failed")

    def check(self, now: float) -> None:
        """Start the sleep of each version idle past its time."""
        for version in self.fleet.versions():
            sleep = version.sleep
            seconds = self.choices.for_model(version.name)
            if seconds <= 0 or sleep.asleep or version.status not in SLEEP_STATUSES:
                continue
            if not is_idle(version, self.holds) or not version.engine.ready:
                sleep.last_active = now  # busy (or restarting): idleness counts from when it is seen idle
            elif now - sleep.last_active >= seconds:
                log.info("model %s %s idle for %g s: it sleeps", version.name, version.label, seconds)
                begin_sleep(version, self.drain_timeout, self.holds, self.spawn)

    async def sleep(self, version: ModelVersion) -> bool:
        """Put the version to sleep now (draining it first), or wait for the sleep
        under way; whether it sleeps (False: its engine is not running)."""
        sleep = version.sleep
        task = begin_sleep(version, self.drain_timeout, self.holds, self.spawn)
        if task is None and sleep.transition is not None and not sleep.waking:
            task = sleep.transition
        if task is not None:
            await asyncio.shield(task)
        return sleep.asleep

    async def wake(self, version: ModelVersion, deadline: float | None = None) -> None:
        await wake_for(version, deadline, self.spawn)

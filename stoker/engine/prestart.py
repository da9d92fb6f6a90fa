"""Engine processes started before the front end needs them.

`stoker serve` spends about a second importing its front end (FastAPI, the
control plane, the fleet) before its lifespan asks for an engine, and the
engine process then spends as long again importing torch and the model code.
On a two-core machine those two imports can run at once: prestart() spawns
the engine processes as soon as the settings are read, each imports its
core's module and then waits for run_engine's arguments; the first start of
each engine takes one (start_engine), and whatever is left when the fleet is
up is ended (discard). Restarts and wakes spawn afresh: a waiting process
would hold torch's ~200 MB for a moment that may never come.

This module imports nothing of stoker's: the engine's import is the longest
part of a start, so the spawn must not wait for the engine's modules to load
in the front end first (~0.1 s on two cores).
"""

from __future__ import annotations

import gc
import multiprocessing
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext, SpawnProcess
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stoker.engine.process import EngineArgs

_spawn = multiprocessing.get_context("spawn")  # fork + torch threads is unsafe


@dataclass
class _Waiting:
    core_spec: str
    process: SpawnProcess
    orders: Connection
    """The parent's end of the pipe the process waits on for its EngineArgs."""


_waiting: list[_Waiting] = []


def prestart(core_spec: str, count: int) -> None:
    """Spawn count engine processes for core_spec, each importing it and then
    waiting for start_engine (or for discard)."""
    for _ in range(count):
        reader, writer = _spawn.Pipe(duplex=False)
        process = _spawn.Process(
            target=run_engine_when_asked, args=(core_spec, reader), name="stoker-engine", daemon=True
        )
        process.start()
        reader.close()  # the child's now: once our writer closes (or we die), its recv() ends
        _waiting.append(_Waiting(core_spec, process, writer))


def start_engine(context: SpawnContext, core_spec: str, args: EngineArgs, name: str) -> SpawnProcess:
    """An engine process running run_engine(*args): a prestarted one for this
    core when one still waits, else a fresh one from context."""
    for waiting in [w for w in _waiting if w.core_spec == core_spec]:
        _waiting.remove(waiting)
        if waiting.process.is_alive() and _send(waiting, args):
            waiting.process.name = name
            return waiting.process
        _end(waiting)  # it died while waiting (killed, out of memory): as if it never was
    from stoker.engine.process import run_engine

    process = context.Process(target=run_engine, args=args, name=name, daemon=True)
    process.start()
    return process


def run_engine_when_asked(core_spec: str, orders: Connection) -> None:
    """Entry point of a prestarted engine process: import the core's module
    (torch and the model code, most of an engine's start) while the front end
    imports its own, then run the engine with the EngineArgs the front end
    sends, or return if it closes the pipe first."""
    # Ctrl-C reaches the whole process group: the front end decides when this
    # process ends. SIGTERM stays default until run_engine, so that
    # multiprocessing's exit handler can end one nobody asked for.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    gc.disable()  # until the engine is ready (stoker.engine.process.freeze_loaded_objects)
    from stoker.engine.process import load_core_factory, run_engine

    try:
        load_core_factory(core_spec)
    except Exception:  # run_engine loads it again and reports why, through the front end
        pass
    try:
        args: EngineArgs = orders.recv()
    except EOFError:
        return
    finally:
        orders.close()
    run_engine(*args)


def discard() -> None:
    """End every process still waiting: the fleet is up without them."""
    while _waiting:
        _end(_waiting.pop())


def waiting_pids() -> list[int]:
    """The processes prestarted and not yet taken or discarded."""
    return [w.process.pid for w in _waiting if w.process.pid is not None]


def _send(waiting: _Waiting, args: EngineArgs) -> bool:
    """The arguments sent to a waiting process (its pipe closed after); False if its end is gone."""
    try:
        waiting.orders.send(args)
    except OSError:
        return False
    waiting.orders.close()
    return True


def _end(waiting: _Waiting) -> None:
    # Ended at once, not given its pipe's EOF to notice: it is most likely still importing
    # (a start refused while its settings are checked), and nothing of it is needed. Its
    # SIGTERM is the default until run_engine, which it never reached.
    waiting.orders.close()
    waiting.process.terminate()
    waiting.process.join(timeout=5)
    if waiting.process.is_alive():
        waiting.process.kill()
        waiting.process.join(timeout=5)

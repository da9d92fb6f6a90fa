"""AsyncEngineClient: the front end's handle on the engine process.

It spawns the engine (stoker.engine.process), routes output deltas to the
request that awaits them, and supervises: when the engine process exits
unexpectedly every in-flight request fails with EngineDeadError, the client
reports not-ready, and a fresh engine is started with backoff.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

import zmq
import zmq.asyncio

from stoker.config import EngineConfig
from stoker.engine import process as proto
from stoker.engine.params import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineStats,
    LoraAnswer,
    LoraCommand,
    LoraInfo,
)
from stoker.engine.pins import PrefixAnswer, PrefixCommand
from stoker.engine.prestart import start_engine

logger = logging.getLogger(__name__)


class EngineUnavailableError(RuntimeError):
    """The engine is starting, restarting or shut down: retry later (HTTP 503)."""


class EngineDeadError(EngineUnavailableError):
    """The engine process died while this request was in flight (HTTP 503)."""


class RequestRejectedError(ValueError):
    """The engine refused the request as invalid (HTTP 400)."""


class EngineStartupError(RuntimeError):
    """The engine failed to load (bad model path, out of memory, ...)."""


class LoraRejectedError(ValueError):
    """The engine refused a LoRA adapter; the message names it and the reason, in one line (HTTP 400)."""


@dataclass
class _Stream:
    queue: asyncio.Queue[list[EngineCoreOutput] | BaseException]
    remaining: int
    """Samples (of n) that have not finished yet."""


@dataclass
class _Incarnation:
    """One engine process and the sockets that belong to it alone, so nothing
    queued for a dead engine can leak into its successor."""

    process: Any
    inp: zmq.Socket[bytes]
    out: zmq.asyncio.Socket
    ready: asyncio.Future[proto.EngineInfo] = field(default_factory=asyncio.Future)
    reader: asyncio.Task[None] | None = None
    serving: bool = False
    """Past its start (adapters registered again included): taking requests, restarted if it dies."""


class AsyncEngineClient:
    def __init__(
        self,
        config: EngineConfig,
        core_spec: str = proto.DEFAULT_CORE,
        startup_timeout: float = 900.0,
        max_restart_backoff: float = 10.0,
    ) -> None:
        self.config = config
        self.core_spec = core_spec
        self.startup_timeout = startup_timeout
        self.max_restart_backoff = max_restart_backoff
        self.restart_count = 0
        """Engine restarts after an unexpected exit (the observability metric reads this)."""
        self.info: proto.EngineInfo | None = None
        self.tokenizer: Any = None
        self.last_error: str | None = None
        self._stats = EngineStats()
        self._streams: dict[str, _Stream] = {}
        self._engine: _Incarnation | None = None
        self._alive = False
        self._closing = False
        self._sleeping = False
        """The process was stopped by sleep(): its exit is no crash, and wake() starts the next one."""
        self._generation = 0
        self._restart_task: asyncio.Task[None] | None = None
        self._resets: dict[int, asyncio.Future[int]] = {}
        """Prefix-cache resets awaiting the engine's answer, by ticket."""
        self._prefix_answers: dict[int, asyncio.Future[PrefixAnswer]] = {}
        """Pinned-prefix commands awaiting the engine's answer, by ticket (the same numbering)."""
        self._lora_answers: dict[int, asyncio.Future[LoraAnswer]] = {}
        """LoRA registrations and removals awaiting the engine's answer, by ticket (the same numbering)."""
        self._loras: dict[str, str] = {}
        """Registered LoRA adapters, name -> path, in registration order: registered again on every engine start."""
        self._next_ticket = 0
        self._dir = tempfile.mkdtemp(prefix="stoker-ipc-")
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context.shadow(self._ctx)
        self._mp = multiprocessing.get_context("spawn")  # fork + torch threads is unsafe

    # ---- state -------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """True while an engine is loaded, warmed up and alive."""
        return self._alive and not self._closing

    @property
    def max_model_len(self) -> int:
        assert self.info is not None, "engine not started"
        return self.info.max_model_len

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def stats(self) -> EngineStats:
        """The latest snapshot the engine pushed (at most ~0.2 s old while busy)."""
        return self._stats

    # ---- lifecycle ---------------------------------------------------------

    async def start(self) -> proto.EngineInfo:
        """Start the engine and wait until it is warmed up; EngineStartupError if it cannot."""
        return await self._spawn()

    async def _spawn(self) -> proto.EngineInfo:
        self._generation += 1
        in_addr = f"ipc://{self._dir}/in-{self._generation}"
        out_addr = f"ipc://{self._dir}/out-{self._generation}"
        inp = self._ctx.socket(zmq.PUSH)
        inp.setsockopt(zmq.SNDHWM, 0)  # never drop or block an add/abort
        inp.bind(in_addr)
        out = self._actx.socket(zmq.PULL)
        out.setsockopt(zmq.RCVHWM, 0)
        out.bind(out_addr)
        args: proto.EngineArgs = (
            self.config,
            self.core_spec,
            in_addr,
            out_addr,
            os.getpid(),
            logging.getLogger("stoker").getEffectiveLevel(),
        )
        process = start_engine(self._mp, self.core_spec, args, f"stoker-engine-{self._generation}")
        engine = _Incarnation(process=process, inp=inp, out=out)
        self._engine = engine
        engine.reader = asyncio.create_task(self._read(engine))
        loop = asyncio.get_running_loop()
        loop.add_reader(process.sentinel, self._on_exit, engine)
        try:
            info = await asyncio.wait_for(asyncio.shield(engine.ready), self.startup_timeout)
        except (asyncio.TimeoutError, EngineStartupError) as exc:
            self._discard(engine, kill=True)
            if isinstance(exc, EngineStartupError):
                raise
            raise EngineStartupError(f"engine did not become ready in {self.startup_timeout:.0f} s") from None
        self.info = info
        if self.tokenizer is None:
            self.tokenizer = pickle.loads(info.tokenizer)
        # Before it takes requests: a restarted (or woken) engine serves the adapters its predecessor served.
        await self._register_loras(engine)
        engine.serving = True
        self._alive = True
        logger.info("engine ready (pid %d, generation %d)", info.pid, self._generation)
        return info

    async def _register_loras(self, engine: _Incarnation) -> None:
        for name, path in list(self._loras.items()):
            try:
                answer = await self._lora_call(engine, "add", name, path, self.startup_timeout)
            except EngineUnavailableError as exc:
                self._discard(engine, kill=True)
                raise EngineStartupError(f"LoRA adapter {name!r} was not registered again: {exc}") from None
            if answer.error is not None:
                # Its file changed or vanished since it was added: served no more, said once, loudly.
                logger.error("LoRA adapter %s dropped on engine start: %s", name, answer.error)
                self._loras.pop(name, None)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine: ask politely, then kill. In-flight requests fail."""
        self._closing = True
        await self._stop(timeout)
        self._fail_all(EngineUnavailableError("the server is shutting down"))
        self._fail_resets(EngineUnavailableError("the server is shutting down"))
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

    async def sleep(self, timeout: float = 10.0) -> None:
        """Stop the engine process (its weights and KV cache go with it) and keep
        what wake() needs: the config, the tokenizer, the last EngineInfo. Not a
        crash: no restart follows. Requests still in flight fail, so the caller
        drains first (stoker.server.sleep)."""
        self._sleeping = True
        await self._stop(timeout)
        self._fail_all(EngineUnavailableError("the engine went to sleep; please retry"))
        self._fail_resets(EngineUnavailableError("the engine went to sleep; please retry"))
        self._stats = EngineStats()  # nothing runs, nothing waits: the gauges read zero

    async def wake(self) -> proto.EngineInfo:
        """Start a new engine process after sleep(); EngineStartupError if it cannot
        (it stays asleep then, and a later wake() tries again)."""
        self._sleeping = False
        try:
            return await self._spawn()
        except BaseException:
            self._sleeping = True
            raise

    async def _stop(self, timeout: float) -> None:
        """Ask the engine process to exit, kill it past timeout; no restart is due."""
        if self._restart_task is not None:
            self._restart_task.cancel()
        engine = self._engine
        if engine is None:
            return
        if not engine.ready.done():
            # Still starting (a restart, a wake): it holds no request, and its sockets may
            # not be connected yet, so a SHUTDOWN sent now could be dropped and then
            # waited on for the whole timeout.
            self._discard(engine, kill=True)
            return
        try:
            engine.inp.send_multipart([proto.SHUTDOWN, b""], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while engine.process.is_alive() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        self._discard(engine, kill=True)

    def _discard(self, engine: _Incarnation, kill: bool) -> None:
        try:
            asyncio.get_running_loop().remove_reader(engine.process.sentinel)
        except (RuntimeError, ValueError, OSError):
            pass
        if engine.reader is not None:
            engine.reader.cancel()
        if kill and engine.process.is_alive():
            engine.process.kill()
        engine.process.join(timeout=5)
        engine.inp.close(linger=0)
        engine.out.close(linger=0)
        if self._engine is engine:
            self._engine = None
            self._alive = False

    def _on_exit(self, engine: _Incarnation) -> None:
        """The engine process ended (sentinel readable)."""
        self._discard(engine, kill=False)
        if not engine.ready.done():
            engine.ready.set_exception(
                EngineStartupError(self.last_error or f"engine exited with code {engine.process.exitcode}")
            )
            engine.ready.exception()  # the starter may be gone; keep asyncio quiet
            return
        if not engine.serving:  # died while its adapters were registered again: the starter reports it
            self._fail_resets(EngineDeadError(self.last_error or "the engine process died while starting"))
            return
        if self._closing or self._sleeping:
            return
        logger.error("engine process %s exited with code %s; restarting", engine.process.pid, engine.process.exitcode)
        self._fail_all(EngineDeadError("the engine process died; please retry"))
        self._fail_resets(EngineDeadError("the engine process died; please retry"))
        self.restart_count += 1
        self._restart_task = asyncio.create_task(self._restart())

    async def _restart(self) -> None:
        backoff = 0.5
        while not self._closing:
            try:
                await self._spawn()
                return
            except EngineStartupError as exc:
                logger.error("engine restart failed: %s", exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.max_restart_backoff)

    def _fail_resets(self, error: BaseException) -> None:
        resets, self._resets = self._resets, {}
        answers, self._prefix_answers = self._prefix_answers, {}
        loras, self._lora_answers = self._lora_answers, {}
        futures: list[asyncio.Future[int] | asyncio.Future[PrefixAnswer] | asyncio.Future[LoraAnswer]] = [
            *resets.values(),
            *answers.values(),
            *loras.values(),
        ]
        for future in futures:
            if not future.done():
                future.set_exception(error)

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.queue.put_nowait(error)

    # ---- output routing ----------------------------------------------------

    async def _read(self, engine: _Incarnation) -> None:
        while True:
            kind, payload = await engine.out.recv_multipart()
            if kind == proto.OUTPUTS:
                self._dispatch(proto.outputs_decoder.decode(payload))
            elif kind == proto.STATS:
                self._stats = proto.stats_decoder.decode(payload)
            elif kind == proto.REJECT:
                rejection = proto.rejection_decoder.decode(payload)
                stream = self._streams.pop(rejection.request_id, None)
                if stream is not None:
                    stream.queue.put_nowait(RequestRejectedError(rejection.message))
            elif kind == proto.PREFIX_CACHE_RESET:
                reset = proto.reset_decoder.decode(payload)
                future = self._resets.pop(reset.ticket, None)
                if future is not None and not future.done():
                    future.set_result(reset.num_blocks)
            elif kind == proto.PREFIX_ANSWER:
                answer = proto.prefix_answer_decoder.decode(payload)
                waiting = self._prefix_answers.pop(answer.ticket, None)
                if waiting is not None and not waiting.done():
                    waiting.set_result(answer)
            elif kind == proto.LORA_ANSWER:
                lora = proto.lora_answer_decoder.decode(payload)
                pending = self._lora_answers.pop(lora.ticket, None)
                if pending is not None and not pending.done():
                    pending.set_result(lora)
            elif kind == proto.READY:
                if not engine.ready.done():
                    engine.ready.set_result(proto.info_decoder.decode(payload))
            elif kind == proto.FATAL:
                self.last_error = payload.decode(errors="replace")
                if engine.ready.done():  # before ready, the starter reports it (EngineStartupError)
                    logger.error("engine failed:\n%s", self.last_error)

    def _dispatch(self, outputs: list[EngineCoreOutput]) -> None:
        # One queue item per request per step keeps the event loop's work
        # proportional to requests, not tokens.
        grouped: dict[str, list[EngineCoreOutput]] = {}
        for output in outputs:
            grouped.setdefault(output.request_id, []).append(output)
        for request_id, deltas in grouped.items():
            stream = self._streams.get(request_id)
            if stream is None:
                continue  # aborted or failed already
            stream.remaining -= sum(1 for d in deltas if d.finished)
            if stream.remaining <= 0:
                del self._streams[request_id]
            stream.queue.put_nowait(deltas)

    # ---- requests ----------------------------------------------------------

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        """Submit a request and yield its deltas until all n samples finish.

        Raises EngineUnavailableError / EngineDeadError / RequestRejectedError.
        Closing or cancelling the iterator early aborts the request in the engine.
        """
        if request.request_id in self._streams:
            raise RequestRejectedError(f"duplicate request id {request.request_id!r}")
        engine = self._engine
        if not self.ready or engine is None:
            raise EngineUnavailableError("the engine is not ready; please retry")
        stream = _Stream(queue=asyncio.Queue(), remaining=request.sampling_params.n)
        self._streams[request.request_id] = stream
        engine.inp.send_multipart([proto.ADD, proto.encoder.encode(request)], zmq.NOBLOCK)
        # Count finishes as they are consumed: stream.remaining is the
        # dispatcher's count, which runs ahead while items wait in the queue.
        unfinished = request.sampling_params.n
        try:
            while unfinished > 0:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                for delta in item:
                    if delta.finished:
                        unfinished -= 1
                    yield delta
        finally:
            if self._streams.get(request.request_id) is stream:
                self.abort([request.request_id])

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests; their streams end at once. Safe from finally blocks (never awaits)."""
        for request_id in request_ids:
            self._streams.pop(request_id, None)
        engine = self._engine
        if engine is not None and request_ids:
            try:
                engine.inp.send_multipart([proto.ABORT, proto.encoder.encode(request_ids)], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # the engine is gone; its requests died with it

    async def reset_prefix_cache(self, timeout: float = 10.0) -> int:
        """Ask the engine to drop the prefix cache's unused blocks (between two
        steps); returns how many it dropped. EngineUnavailableError if the
        engine is not ready, dies meanwhile, or does not answer in time."""
        engine = self._engine
        if not self.ready or engine is None:
            raise EngineUnavailableError("the engine is not ready; please retry")
        self._next_ticket += 1
        ticket = self._next_ticket
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._resets[ticket] = future
        engine.inp.send_multipart([proto.RESET_PREFIX_CACHE, proto.encoder.encode(ticket)], zmq.NOBLOCK)
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise EngineUnavailableError(f"the engine did not reset its prefix cache within {timeout:.0f} s") from None
        finally:
            self._resets.pop(ticket, None)

    async def prefixes(
        self,
        action: Literal["pin", "unpin", "list"],
        label: str = "",
        token_ids: list[int] | None = None,
        timeout: float = 10.0,
    ) -> PrefixAnswer:
        """Pin a prefix (computed first, as a prompt-only request), unpin one, or list
        them (docs/prefix-cache.md). EngineUnavailableError if the engine is not ready,
        dies meanwhile, or does not answer within timeout (a pin still running then
        completes in the engine all the same)."""
        engine = self._engine
        if not self.ready or engine is None:
            raise EngineUnavailableError("the engine is not ready; please retry")
        self._next_ticket += 1
        ticket = self._next_ticket
        future: asyncio.Future[PrefixAnswer] = asyncio.get_running_loop().create_future()
        self._prefix_answers[ticket] = future
        command = PrefixCommand(ticket, action, label, list(token_ids or []))
        engine.inp.send_multipart([proto.PREFIXES, proto.encoder.encode(command)], zmq.NOBLOCK)
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise EngineUnavailableError(f"the engine did not answer the {action} within {timeout:.0f} s") from None
        finally:
            self._prefix_answers.pop(ticket, None)

    # ---- LoRA adapters -----------------------------------------------------

    async def add_lora(self, name: str, path: str, timeout: float = 120.0) -> LoraInfo:
        """Load and validate an adapter in the engine (on its loader thread; steps go on) and
        register it; requests then name it in EngineCoreRequest.lora_name. Every later engine
        start registers it again. LoraRejectedError (naming the adapter and the reason) if the
        engine refuses it; EngineUnavailableError if the engine is not ready, dies meanwhile
        or does not answer within timeout."""
        engine = self._engine
        if not self.ready or engine is None:
            raise EngineUnavailableError("the engine is not ready; please retry")
        answer = await self._lora_call(engine, "add", name, path, timeout)
        if answer.error is not None or answer.info is None:
            raise LoraRejectedError(answer.error or f"LoRA adapter {name!r} was refused")
        self._loras[name] = path
        return answer.info

    async def remove_lora(self, name: str, timeout: float = 10.0) -> None:
        """Forget an adapter: the engine drops it from memory, and requests still naming it end
        with an error (drain them first). An unknown name changes nothing."""
        known = self._loras.pop(name, None) is not None
        engine = self._engine
        if not known or not self.ready or engine is None:
            return  # an engine started later never hears of it
        await self._lora_call(engine, "remove", name, "", timeout)

    def lora_names(self) -> list[str]:
        """The registered adapters' names, in registration order."""
        return list(self._loras)

    async def _lora_call(
        self, engine: _Incarnation, action: Literal["add", "remove"], name: str, path: str, timeout: float
    ) -> LoraAnswer:
        self._next_ticket += 1
        ticket = self._next_ticket
        future: asyncio.Future[LoraAnswer] = asyncio.get_running_loop().create_future()
        self._lora_answers[ticket] = future
        command = LoraCommand(ticket, action, name, path)
        engine.inp.send_multipart([proto.LORA, proto.encoder.encode(command)], zmq.NOBLOCK)
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise EngineUnavailableError(
                f"the engine did not answer the LoRA {action} of {name!r} within {timeout:.0f} s"
            ) from None
        finally:
            self._lora_answers.pop(ticket, None)

    def abort_all_soft(self) -> None:
        """Ask the engine to abort everything in flight but keep the streams open,
        so callers receive a normal finish_reason "abort" (used by the drain)."""
        engine = self._engine
        if engine is not None and self._streams:
            engine.inp.send_multipart([proto.ABORT, proto.encoder.encode(list(self._streams))], zmq.NOBLOCK)

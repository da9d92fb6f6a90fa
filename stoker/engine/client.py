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
from stoker.engine.params import EngineCoreOutput, EngineCoreRequest, EngineStats
from stoker.engine.pins import PrefixAnswer, PrefixCommand

logger = logging.getLogger(__name__)


class EngineUnavailableError(RuntimeError):
    """The engine is starting, restarting or shut down: retry later (HTTP 503)."""


class EngineDeadError(EngineUnavailableError):
    """The engine process died while this request was in flight (HTTP 503)."""


class RequestRejectedError(ValueError):
    """The engine refused the request as invalid (HTTP 400)."""


class EngineStartupError(RuntimeError):
    """The engine failed to load (bad model path, out of memory, ...)."""


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
        self._generation = 0
        self._restart_task: asyncio.Task[None] | None = None
        self._resets: dict[int, asyncio.Future[int]] = {}
        """Prefix-cache resets awaiting the engine's answer, by ticket."""
        self._prefix_answers: dict[int, asyncio.Future[PrefixAnswer]] = {}
        """Pinned-prefix commands awaiting the engine's answer, by ticket (the same numbering)."""
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
        process = self._mp.Process(
            target=proto.run_engine,
            args=(
                self.config,
                self.core_spec,
                in_addr,
                out_addr,
                os.getpid(),
                logging.getLogger("stoker").getEffectiveLevel(),
            ),
            name=f"stoker-engine-{self._generation}",
            daemon=True,
        )
        process.start()
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
        self._alive = True
        logger.info("engine ready (pid %d, generation %d)", info.pid, self._generation)
        return info

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine: ask politely, then kill. In-flight requests fail."""
        self._closing = True
        if self._restart_task is not None:
            self._restart_task.cancel()
        engine = self._engine
        if engine is not None:
            try:
                engine.inp.send_multipart([proto.SHUTDOWN, b""], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while engine.process.is_alive() and loop.time() < deadline:
                await asyncio.sleep(0.05)
            self._discard(engine, kill=True)
        self._fail_all(EngineUnavailableError("the server is shutting down"))
        self._fail_resets(EngineUnavailableError("the server is shutting down"))
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

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
        if self._closing:
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
        futures: list[asyncio.Future[int] | asyncio.Future[PrefixAnswer]] = [*resets.values(), *answers.values()]
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

    def abort_all_soft(self) -> None:
        """Ask the engine to abort everything in flight but keep the streams open,
        so callers receive a normal finish_reason "abort" (used by the drain)."""
        engine = self._engine
        if engine is not None and self._streams:
            engine.inp.send_multipart([proto.ABORT, proto.encoder.encode(list(self._streams))], zmq.NOBLOCK)

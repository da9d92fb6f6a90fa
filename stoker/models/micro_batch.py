"""Forward passes shared by concurrent requests: the front end's small models
(the embedding model, rerankers) collect what requests bring into batches of
at most max_batch items and run each batch in a worker thread, so the event
loop stays free and one forward serves many requests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

In = TypeVar("In")
Out = TypeVar("Out")


class BatcherClosedError(RuntimeError):
    """The model's batcher was closed (unloaded, or the server shut down) before these items ran."""


class MicroBatcher(Generic[In, Out]):
    def __init__(
        self,
        name: str,
        forward: Callable[[list[In]], Sequence[Out]],
        max_batch: int,
        sort_key: Callable[[In], int] | None = None,
    ) -> None:
        self.name = name
        self.max_batch = max_batch
        self._forward = forward
        self._sort_key = sort_key
        """Items of similar size together waste less padding: the order within a batch."""
        self._pending: list[tuple[In, asyncio.Future[Out]]] = []
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self._running = 0

    @property
    def waiting(self) -> int:
        """Items queued or in the forward pass now."""
        return len(self._pending) + self._running

    async def run(self, items: Sequence[In]) -> list[Out]:
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done():
            self._wakeup = asyncio.Event()
            self._worker = asyncio.create_task(self._loop())
        futures = [loop.create_future() for _ in items]
        self._pending.extend(zip(items, futures))
        assert self._wakeup is not None
        self._wakeup.set()
        return list(await asyncio.gather(*futures))

    async def _loop(self) -> None:
        assert self._wakeup is not None
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._pending:
                batch = self._pending[: self.max_batch]
                del self._pending[: self.max_batch]
                if self._sort_key is not None:
                    key = self._sort_key
                    batch.sort(key=lambda entry: key(entry[0]))
                live = [(item, fut) for item, fut in batch if not fut.done()]
                if not live:
                    continue
                self._running = len(live)
                try:
                    results = await asyncio.to_thread(self._forward, [item for item, _ in live])
                except Exception as exc:  # fail these items, keep serving others
                    for _, fut in live:
                        if not fut.done():
                            fut.set_exception(exc)
                    continue
                finally:
                    self._running = 0
                for (_, fut), result in zip(live, results):
                    if not fut.done():
                        fut.set_result(result)

    def close(self) -> None:
        """Stop the worker; whatever still waits fails with BatcherClosedError instead of hanging."""
        if self._worker is not None:
            self._worker.cancel()
        pending, self._pending = self._pending, []
        for _, fut in pending:
            if not fut.done():
                fut.set_exception(BatcherClosedError(f"{self.name} was unloaded; please retry"))

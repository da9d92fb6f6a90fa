"""A decode worker's pulls (kv_role decode): a prefix-cache hit that comes
from a peer. The disk tier's fetch path (kv_disk_tier.py) with the prefill
worker as the source.

A waiting request a PD router split (Request.kv_transfer) whose prompt
continues past its RAM hits gets free blocks held for it, and a fetch thread
pulls the missing blocks of its room from the prefill worker, verifying each
(checksum, layout, chained hash of parent and tokens) before copying its bytes
straight into its block (no other request can see those blocks, so the step
loop runs on meanwhile). Blocks it holds already are not asked for. The request
waits (others are scheduled) until the pull is done or kv_transfer_timeout has
passed since its arrival; then the blocks that arrived are indexed in the RAM
prefix cache by their hashes and the scheduler's ordinary lookup finds them.
Whatever did not arrive (a failed, refused or timed-out pull, a block that
failed its checks, too few free blocks) is computed here: never a wrong token.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, CancelledError, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from stoker.engine.kv_block_bytes import KVBlockBytes
from stoker.engine.kv_cache import Block, BlockPool, hashes_past
from stoker.engine.kv_disk_format import DiskLayout
from stoker.engine.kv_disk_tier import Fetch
from stoker.engine.kv_transfer import PullCancel, PullResult, pull_blocks
from stoker.engine.outputs import RequestKey
from stoker.engine.request import Request

log = logging.getLogger("stoker.engine.kv_transfer")

MAX_PULLS = 4
"""Pulls running at once (threads); more wait their turn, within their own deadline."""
CANCEL_GRACE_S = 1.0
"""After a pull's deadline, how long its request waits for the cancelled pull to hand back what it had."""


@dataclass
class _Pull:
    future: Future[PullResult]
    cancel: PullCancel
    started: float
    """time.monotonic() when it was submitted."""
    deadline: float
    """time.monotonic() past which it is cancelled."""
    held: list[Block]
    """The request's RAM hits, a reference taken so they stay while it waits."""
    targets: list[Block]
    """Blocks taken from the free queue for the pull to copy into, in chain order."""
    peer: str
    lora_name: str | None = None
    hash_root: bytes | None = None
    timed_out: bool = False


class PeerFetch:
    def __init__(
        self, layout: DiskLayout, block_bytes: KVBlockBytes, pool: BlockPool, block_size: int, timeout: float
    ) -> None:
        self.layout = layout
        self.block_bytes = block_bytes
        self.pool = pool
        self.block_size = block_size
        self.timeout = timeout
        self._pulls: dict[RequestKey, _Pull] = {}
        self._tried: set[RequestKey] = set()
        self._abandoned: list[_Pull] = []
        """Pulls whose request left, still running: their blocks stay held until they stop."""
        self._executor = ThreadPoolExecutor(max_workers=MAX_PULLS, thread_name_prefix="stoker-kv-pull")
        self._releases = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stoker-kv-release")
        """Pulls of no blocks (kept apart: one waiting for a room not opened yet must not hold up real pulls)."""
        self._warned: set[str] = set()
        self.num_blocks_received = 0
        self.num_bytes_received = 0
        self.num_blocks_skipped = 0
        self.num_pulls = 0
        self.pull_seconds = 0.0
        self.num_failed = 0
        self.num_timed_out = 0

    def fetch(self, request: Request, cached: list[Block]) -> Fetch:
        self.reap()
        pull = self._pulls.get(request.key)
        if pull is None:
            return self._start(request, cached)
        now = time.monotonic()
        if not pull.future.done():
            if now < pull.deadline:
                return Fetch.WAITING
            if not pull.timed_out:
                # Keep what arrived: the cancelled pull returns at once with the blocks it wrote.
                pull.timed_out = True
                pull.cancel.cancel()
                pull.future.cancel()
                return Fetch.WAITING
            if now < pull.deadline + CANCEL_GRACE_S:
                return Fetch.WAITING
            del self._pulls[request.key]
            self._abandoned.append(pull)
            self.num_timed_out += 1
            self._warn(pull.peer, f"a pull took over {self.timeout:.1f}s; computing the prompt instead")
            return Fetch.NOTHING
        del self._pulls[request.key]
        return Fetch.LOADED if self._finish(pull) else Fetch.NOTHING

    def _start(self, request: Request, cached: list[Block]) -> Fetch:
        params = request.kv_transfer
        if params is None or params.send or request.key in self._tried:
            return Fetch.NOTHING
        self._tried.add(request.key)
        self.num_blocks_skipped += len(cached)
        first_parent, hashes = hashes_past(request, cached, self.block_size)
        peer = f"{params.peer_host}:{params.peer_port}"
        if not hashes:
            if cached and params.peer_host and params.peer_port:  # the whole prompt is held here already
                self._release_room(params.peer_host, params.peer_port, params.room, request.arrival_time)
            return Fetch.NOTHING
        # Its deadline counts from its arrival (time.time() at the front end), as the router's client waits.
        deadline = time.monotonic() + (request.arrival_time + self.timeout - time.time())
        if not params.peer_host or not params.peer_port:
            self.num_failed += 1
            self._warn(peer, "no prefill worker address: computing the prompt")
            return Fetch.NOTHING
        if deadline <= time.monotonic():
            self.num_timed_out += 1  # it waited its whole timeout in the queue
            self._warn(peer, "no time left to pull: computing the prompt")
            return Fetch.NOTHING
        # The request's RAM hits are held so no allocation takes them while it waits, and the pull
        # copies into blocks held for it, which nothing else reads or writes meanwhile.
        self.pool.touch(cached)
        targets = self.pool.allocate(min(len(hashes), self.pool.num_free))
        cancel = PullCancel()

        def write(index: int, payload: memoryview) -> None:
            self.block_bytes.write(targets[index].block_id, payload)

        future = self._executor.submit(
            pull_blocks,
            params.peer_host,
            params.peer_port,
            self.layout,
            params.room,
            len(cached),
            hashes[: len(targets)],
            first_parent,
            write,
            deadline,
            cancel,
        )
        self._pulls[request.key] = _Pull(
            future,
            cancel,
            time.monotonic(),
            deadline,
            list(cached),
            targets,
            peer,
            request.lora_name,
            request.hash_root,
        )
        return Fetch.WAITING

    def _release_room(self, host: str, port: int, room: int, arrival_time: float) -> None:
        """Every block of the prompt is here already: a pull of none, so the prefill worker lets its room go
        now rather than when it expires. Nobody waits for it."""
        deadline = time.monotonic() + (arrival_time + self.timeout - time.time())

        def ignore(index: int, payload: memoryview) -> None:
            raise AssertionError("a pull of no blocks received one")

        self._releases.submit(pull_blocks, host, port, self.layout, room, 0, [], None, ignore, deadline, PullCancel())

    def _finish(self, pull: _Pull) -> bool:
        """On the step loop, the pull over: index what it brought as cached, release the rest."""
        try:
            result = pull.future.result()
        except CancelledError:
            result = PullResult(failure="timed out before it started")
        except Exception as exc:  # a pull's failure is a miss, never a failed request
            log.exception("KV transfer: a pull failed")
            result = PullResult(failure=str(exc))
        for block, (_, parent, tokens) in zip(pull.targets, result.loaded):  # verified on arrival
            self.pool.cache_block(block, parent, tokens, pull.lora_name, pull.hash_root)
        self.pool.free(list(reversed(pull.targets)))
        self.pool.free(list(reversed(pull.held)))
        self.num_pulls += 1
        self.pull_seconds += time.monotonic() - pull.started
        self.num_blocks_received += len(result.loaded)
        self.num_bytes_received += result.bytes_received
        if pull.timed_out or result.timed_out:
            self.num_timed_out += 1
            self._warn(pull.peer, f"a pull took over {self.timeout:.1f}s; computing the rest of the prompt")
        elif result.failure is not None and len(result.loaded) < len(pull.targets):
            self.num_failed += 1
            self._warn(pull.peer, f"{result.failure}; computing the rest of the prompt")
        return bool(result.loaded)

    def _warn(self, peer: str, message: str) -> None:
        """Logged once per prefill worker: a peer down would otherwise log every request."""
        if peer not in self._warned:
            self._warned.add(peer)
            log.warning("KV transfer from %s: %s (further failures are counted, not logged)", peer, message)

    def reap(self) -> None:
        """Release the blocks of abandoned pulls that have stopped."""
        for pull in [pull for pull in self._abandoned if pull.future.done()]:
            self._abandoned.remove(pull)
            self.pool.free(list(reversed(pull.targets)))
            self.pool.free(list(reversed(pull.held)))

    def forget(self, key: RequestKey) -> None:
        """The request left the scheduler (finished, aborted): stop its pull, which closes the connection
        and so releases the prefill worker's room."""
        pull = self._pulls.pop(key, None)
        if pull is not None:
            pull.cancel.cancel()
            pull.future.cancel()
            self._abandoned.append(pull)
            self.reap()
        self._tried.discard(key)

    def wait(self, timeout: float) -> None:
        """An otherwise idle step: wait a little for a pull rather than spin."""
        if self._pulls:
            wait([pull.future for pull in self._pulls.values()], timeout, FIRST_COMPLETED)

    def pulling(self, key: RequestKey) -> bool:
        return key in self._pulls

    @property
    def loading(self) -> bool:
        return bool(self._pulls) or bool(self._abandoned)

    def close(self) -> None:
        for pull in [*self._pulls.values(), *self._abandoned]:
            pull.cancel.cancel()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._releases.shutdown(wait=False, cancel_futures=True)

"""A prefill worker's parked prompts (kv_role prefill): each request a PD
router split runs its prompt here, and its full KV blocks wait under its room
(sglang-router's bootstrap_room) until the decode worker pulls them.

Blocks are parked as soon as a prefill step has computed and hashed them (the
pull streams while the prompt's later chunks are still computing), each with
an extra reference so nothing reuses it while it waits. References are taken
and dropped on the step loop only (the block pool is not thread-safe): the KV
transfer server's threads read a room under its lock and hand the rooms they
are done with back through a list the step loop drains (KVSender.settle).

A room ends when its pull is done, when the puller goes away, or when no pull
claimed it within kv_transfer_timeout of its prompt finishing (expired). A
prompt aborted or failed marks its room failed, so a pull waiting for it is
answered at once; the blocks parked before that are still good and are sent.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import Enum, auto

from stoker.engine.kv_cache import Block, KVCacheManager
from stoker.engine.outputs import RequestKey
from stoker.engine.params import FinishReason
from stoker.engine.request import Request


class RoomState(Enum):
    OPEN = auto()
    """Its prompt is still computing: more blocks may come."""
    COMPLETE = auto()
    """Its prompt finished: every full block is parked."""
    FAILED = auto()
    """Its prompt was aborted or failed: no more blocks will come."""


@dataclass(frozen=True)
class ParkedBlock:
    block: Block
    """Referenced by the room until it is released."""
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]


@dataclass
class Room:
    room_id: int
    blocks: list[ParkedBlock] = field(default_factory=list)
    """The prompt's full blocks in chain order; only the step loop appends."""
    state: RoomState = RoomState.OPEN
    claimed: bool = False
    """A pull has it: no other pull may, and it no longer expires."""
    settled_at: float = 0.0
    """time.monotonic() when it stopped growing (complete or failed); expiry counts from there."""


class Rooms:
    """The parked rooms, shared by the step loop and the KV transfer server's threads."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._cond = threading.Condition()
        self._rooms: dict[int, Room] = {}
        self._released: list[Room] = []
        """Rooms the server is done with, for the step loop to drop their references."""
        self.num_expired = 0

    # ------------------------------------------------------ the step loop

    def open(self, room_id: int) -> None:
        with self._cond:
            if room_id in self._rooms:
                raise ValueError(f"bootstrap_room {room_id} is already in use on this prefill worker")
            self._rooms[room_id] = Room(room_id)
            self._cond.notify_all()

    def park(self, room_id: int, blocks: list[Block], kv: KVCacheManager) -> None:
        """Reference `blocks` (hashed, full, the next in the room's chain) under the room; nothing if the
        room is gone (its puller left): then they stay the request's alone."""
        with self._cond:
            room = self._rooms.get(room_id)
            if room is None or room.state is not RoomState.OPEN:
                return
            kv.pool.touch(blocks)
            for block in blocks:
                assert block.block_hash is not None and block.token_ids is not None
                room.blocks.append(ParkedBlock(block, block.block_hash, block.parent_hash, block.token_ids))
            self._cond.notify_all()

    def close(self, room_id: int, state: RoomState) -> None:
        with self._cond:
            room = self._rooms.get(room_id)
            if room is not None and room.state is RoomState.OPEN:
                room.state = state
                room.settled_at = time.monotonic()
                self._cond.notify_all()

    def take_releases(self, now: float) -> list[Room]:
        """Rooms whose pull is over, and those that waited past the timeout (expired), out of the index."""
        with self._cond:
            done, self._released = self._released, []
            for room in list(self._rooms.values()):
                if room.claimed or room.state is RoomState.OPEN:
                    continue
                if room.state is RoomState.COMPLETE and not room.blocks:
                    # A prompt shorter than a block: nothing to pull, and no decode worker will ask.
                    del self._rooms[room.room_id]
                    done.append(room)
                elif now - room.settled_at > self.timeout:
                    del self._rooms[room.room_id]
                    self.num_expired += 1
                    done.append(room)
            return done

    def num_blocks(self, room_id: int) -> int | None:
        """Blocks parked in the room; None when it is gone."""
        with self._cond:
            room = self._rooms.get(room_id)
            return None if room is None else len(room.blocks)

    def is_claimed(self, room_id: int) -> bool:
        """Whether a pull has the room (its PULL has arrived)."""
        with self._cond:
            room = self._rooms.get(room_id)
            return room is not None and room.claimed

    @property
    def num_parked(self) -> int:
        with self._cond:
            return len(self._rooms)

    # ------------------------------------------------- the server's threads

    def claim(self, room_id: int, timeout: float) -> Room | None:
        """The room, now the caller's; waits up to `timeout` for a room not opened yet (the router sends the
        request to both workers at once). None: no such room (never opened, or another pull has it)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                room = self._rooms.get(room_id)
                if room is not None:
                    if room.claimed:
                        return None
                    room.claimed = True
                    return room
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def block_at(self, room: Room, index: int, deadline: float) -> ParkedBlock | None:
        """The room's block `index`, waiting for its prompt to compute it until `deadline`; None when it has
        not come (the prompt finished or failed short of it, or time ran out)."""
        with self._cond:
            while True:
                if index < len(room.blocks):
                    return room.blocks[index]
                left = deadline - time.monotonic()
                if room.state is not RoomState.OPEN or left <= 0:
                    return None
                self._cond.wait(left)

    def state(self, room: Room) -> RoomState:
        with self._cond:
            return room.state

    def release(self, room: Room) -> None:
        """The pull is over (done, failed, or its puller gone): the step loop drops the references."""
        with self._cond:
            if self._rooms.get(room.room_id) is room:
                del self._rooms[room.room_id]
                room.state = RoomState.FAILED if room.state is RoomState.OPEN else room.state
                self._released.append(room)

    def wake(self) -> None:
        """Stop waits (shutting down)."""
        with self._cond:
            self._cond.notify_all()


class KVSender:
    """The step loop's side of the parked rooms: which running requests park into which room."""

    def __init__(self, rooms: Rooms, kv: KVCacheManager) -> None:
        self.rooms = rooms
        self.kv = kv
        self._owners: dict[RequestKey, int] = {}

    def add(self, request: Request, room_id: int) -> None:
        """Before the request joins the scheduler; ValueError (nothing changed) when the room is in use."""
        self.rooms.open(room_id)
        self._owners[request.key] = room_id

    def collect(self) -> None:
        """After a step: the blocks it computed for the rooms' requests, parked at once."""
        for key, room_id in self._owners.items():
            self._park_new(key, room_id)

    def _park_new(self, key: RequestKey, room_id: int) -> None:
        blocks = self.kv.req_blocks.get(key)
        if not blocks:
            return  # waiting, or preempted: its hashed blocks stay parked, the rest come after its recompute
        parked = self.rooms.num_blocks(room_id)
        hashed = min(self.kv.num_hashed.get(key, 0), len(blocks))
        if parked is not None and hashed > parked:
            self.rooms.park(room_id, blocks[parked:hashed], self.kv)

    def on_remove(self, request: Request) -> None:
        """The request leaves the scheduler (its blocks are about to be freed): park what it computed last,
        then close its room, failed unless it finished normally."""
        room_id = self._owners.pop(request.key, None)
        if room_id is None:
            return
        finished = request.is_finished and request.finish_reason is not FinishReason.ABORT
        if finished:
            self._park_new(request.key, room_id)
        self.rooms.close(room_id, RoomState.COMPLETE if finished else RoomState.FAILED)

    def settle(self) -> None:
        """Drop the references of rooms pulled, abandoned or expired."""
        for room in self.rooms.take_releases(time.monotonic()):
            self.kv.pool.free([parked.block for parked in reversed(room.blocks)])

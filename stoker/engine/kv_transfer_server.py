"""A prefill worker's KV transfer server (kv_role prefill): decode workers
connect, check that the KV layouts match, and pull a room's blocks
(kv_transfer_wire.py has the protocol; kv_transfer_rooms.py the rooms).

One thread accepts; each connection is served on its own thread, at most
MAX_CONNECTIONS at once (one more is answered FAILED "busy" and closed: its
decode worker computes the prompt itself). A block's bytes are copied out of
the KV tensors on the connection's thread while the room references the
block, then encoded with its hashes and checksum as the disk tier files it.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time

from stoker.engine.kv_block_bytes import KVBlockBytes
from stoker.engine.kv_disk_format import DiskLayout, StoredBlock, encode_block
from stoker.engine.kv_transfer_rooms import ParkedBlock, Room, Rooms, RoomState
from stoker.engine.kv_transfer_wire import (
    Kind,
    ProtocolError,
    hello_payload,
    layout_difference,
    parse_hello,
    parse_pull,
    recv_frame,
    send_frame,
)

log = logging.getLogger("stoker.engine.kv_transfer")

MAX_CONNECTIONS = 16
"""Pulls served at once; each holds a thread and one block's bytes at a time."""
IO_TIMEOUT_S = 10.0
"""Longest a connection may leave a read or a write unfinished before it is dropped."""
ACCEPT_POLL_S = 0.5
"""How often the accepting thread looks up from accept() to see whether it should stop."""
PEER_POLL_S = 0.2
"""While a pull waits for its prompt's next block, how often it checks that the puller is still there."""


class KVTransferServer:
    def __init__(
        self, host: str, port: int, layout: DiskLayout, rooms: Rooms, block_bytes: KVBlockBytes, timeout: float
    ) -> None:
        self.layout = layout
        self.rooms = rooms
        self.block_bytes = block_bytes
        self.timeout = timeout
        self._key = layout.key
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self.num_blocks_sent = 0
        self.num_bytes_sent = 0
        try:
            self._listener = socket.create_server((host, port), reuse_port=False)
        except OSError as exc:
            raise ValueError(
                f"KV transfer server: cannot listen on {host}:{port} (--kv-transfer-host/--kv-transfer-port): "
                f"{exc.strerror or exc}"
            ) from None
        self._listener.settimeout(ACCEPT_POLL_S)
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, name="stoker-kv-transfer", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # the listener was closed
            conn.settimeout(IO_TIMEOUT_S)
            if not self._slots.acquire(blocking=False):
                self._refuse_busy(conn)
                continue
            threading.Thread(target=self._serve, args=(conn,), name="stoker-kv-send", daemon=True).start()

    def _refuse_busy(self, conn: socket.socket) -> None:
        try:
            send_frame(conn, Kind.FAILED, b"busy")
        except OSError:
            pass
        conn.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._handle(conn)
        except (OSError, ProtocolError) as exc:
            log.debug("KV transfer: a connection ended: %s", exc)
        except Exception:  # a thread's failure must never reach the engine; the puller recomputes
            log.exception("KV transfer: serving a pull failed")
        finally:
            conn.close()
            self._slots.release()

    def _handle(self, conn: socket.socket) -> None:
        kind, payload = recv_frame(conn, self.layout)
        theirs = parse_hello(kind, payload)
        send_frame(conn, Kind.HELLO, hello_payload(self.layout))
        difference = layout_difference(self.layout, theirs)
        if difference is not None:
            log.warning("KV transfer: refused a decode worker whose layout differs: %s", difference)
            return  # it sees our HELLO and names the difference itself
        try:
            kind, payload = recv_frame(conn, self.layout)
        except ConnectionError:
            return  # a start-up check (check_peer): hello and goodbye
        room_id, first_index, hashes = parse_pull(kind, payload)
        room = self.rooms.claim(room_id, self.timeout)
        if room is None:
            send_frame(conn, Kind.UNKNOWN)
            return
        try:
            self._send_blocks(conn, room, first_index, hashes)
        finally:
            self.rooms.release(room)

    def _send_blocks(self, conn: socket.socket, room: Room, first_index: int, hashes: list[bytes]) -> None:
        deadline = time.monotonic() + self.timeout
        for offset, wanted in enumerate(hashes):
            parked = self._wait_block(conn, room, first_index + offset, deadline)
            if parked is None:
                failed = self.rooms.state(room) is RoomState.FAILED
                reason = "its prompt failed" if failed else f"no block {first_index + offset} in time"
                send_frame(conn, Kind.FAILED, reason.encode())
                return
            if parked.block_hash != wanted:
                send_frame(conn, Kind.FAILED, f"block {first_index + offset} holds other tokens".encode())
                return
            payload = self.block_bytes.read(parked.block.block_id)
            stored = StoredBlock(parked.block_hash, parked.parent_hash, parked.token_ids, payload)
            sent = send_frame(conn, Kind.BLOCK, encode_block(self._key, stored))
            with self._lock:
                self.num_blocks_sent += 1
                self.num_bytes_sent += sent
        send_frame(conn, Kind.DONE)

    def _wait_block(self, conn: socket.socket, room: Room, index: int, deadline: float) -> ParkedBlock | None:
        """The room's block `index` once its prompt has computed it. The puller sends nothing after its PULL,
        so its socket turning readable means it left (cancelled, or its request aborted): ConnectionError."""
        while True:
            parked = self.rooms.block_at(room, index, min(deadline, time.monotonic() + PEER_POLL_S))
            if parked is not None or self.rooms.state(room) is not RoomState.OPEN or time.monotonic() >= deadline:
                return parked
            if select.select([conn], [], [], 0)[0]:
                raise ConnectionError("the decode worker left while its prompt was computing")

    def close(self) -> None:
        self._closing.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept() on Linux
        except OSError:
            pass  # not supported here: accept() looks up within ACCEPT_POLL_S
        self._listener.close()
        self.rooms.wake()
        self._thread.join(timeout=2 * ACCEPT_POLL_S)

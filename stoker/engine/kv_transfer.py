"""A decode worker's side of the KV transfer's wire (kv_transfer_wire.py): the
start-up check of a prefill worker (check_peer, probe_peer) and one pull of a
room's blocks into blocks of this worker's cache (pull_blocks, run on the
fetch threads of kv_transfer_fetch.py).

Importable without an engine (the server checks --kv-peers before it starts
one): nothing here touches torch.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from stoker.engine.kv_disk_format import DiskLayout, decode_block
from stoker.engine.kv_transfer_wire import (
    FRAME,
    Kind,
    ProtocolError,
    hello_payload,
    layout_difference,
    layout_from_dict,
    parse_hello,
    pull_payload,
    recv_frame,
    send_frame,
)

CONNECT_TIMEOUT_S = 5.0
"""Longest a pull waits for the prefill worker to accept the connection (within its own deadline)."""


@dataclass(frozen=True)
class PeerCheck:
    reachable: bool
    problem: str | None
    """One line naming the peer and what differs or why it could not be reached; None: it matches."""


def probe_peer(host: str, port: int, layout: Mapping[str, str | int], timeout: float) -> PeerCheck:
    """Connect to a prefill worker's KV transfer server and compare layouts (EngineInfo.kv_layout's form)."""
    name = f"prefill worker {host}:{port}"
    here = layout_from_dict(dict(layout))
    try:
        with socket.create_connection((host, port), timeout) as sock:
            sock.settimeout(timeout)
            theirs = _handshake(sock, here)
    except ProtocolError as exc:
        return PeerCheck(True, f"{name}: {exc}")
    except OSError as exc:
        return PeerCheck(False, f"{name}: unreachable ({exc.strerror or exc})")
    difference = layout_difference(here, theirs)
    return PeerCheck(True, None if difference is None else f"{name}: {difference}")


def check_peer(host: str, port: int, layout: Mapping[str, str | int], timeout: float) -> str | None:
    """None when the peer answers with the same layout; else one line ("prefill worker 10.0.0.5:8998: KV dtype
    int8 here, bfloat16 there"). probe_peer also says whether it was reachable at all."""
    return probe_peer(host, port, layout, timeout).problem


def _handshake(sock: socket.socket, layout: DiskLayout) -> DiskLayout:
    send_frame(sock, Kind.HELLO, hello_payload(layout))
    kind, payload = recv_frame(sock, layout)
    return parse_hello(kind, payload)


class PullCancel:
    """Stops a pull from the step loop: a read blocked on the socket returns at once."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None

    @property
    def is_set(self) -> bool:
        return self._event.is_set()

    def attach(self, sock: socket.socket) -> bool:
        """False when the pull was cancelled before its socket existed."""
        with self._lock:
            self._sock = sock
            return not self._event.is_set()

    def cancel(self) -> None:
        with self._lock:
            self._event.set()
            if self._sock is not None:
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # not connected, or closed already


@dataclass
class PullResult:
    loaded: list[tuple[bytes, bytes | None, tuple[int, ...]]] = field(default_factory=list)
    """(hash, parent hash, token ids) of each block written into its target, in chain order."""
    bytes_received: int = 0
    failure: str | None = None
    """Why it stopped short of every block asked for; None when all arrived."""
    timed_out: bool = False
    """It stopped at its deadline (the prefill worker too slow or silent)."""


def pull_blocks(
    host: str,
    port: int,
    layout: DiskLayout,
    room: int,
    first_index: int,
    hashes: list[bytes],
    first_parent: bytes | None,
    write: Callable[[int, memoryview], None],
    deadline: float,
    cancel: PullCancel,
) -> PullResult:
    """Pull blocks first_index.. of `room` (their chained hashes: `hashes`, the first one's parent
    `first_parent`); write(i, payload) puts block i's verified bytes in place. Stops at the first block that
    does not verify, at the peer's FAILED, at `deadline` (time.monotonic()) or when cancelled; never raises."""
    result = PullResult()
    try:
        timeout = deadline - time.monotonic()
        if timeout <= 0:
            result.failure, result.timed_out = "no time left", True
            return result
        with socket.create_connection((host, port), min(timeout, CONNECT_TIMEOUT_S)) as sock:
            if not cancel.attach(sock):
                result.failure = "cancelled"
                return result
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            difference = layout_difference(layout, _handshake(sock, layout))
            if difference is not None:
                result.failure = difference
                return result
            send_frame(sock, Kind.PULL, pull_payload(room, first_index, hashes))
            _receive(sock, layout, hashes, first_parent, write, deadline, result)
    except TimeoutError:
        result.failure, result.timed_out = "timed out", True
    except (OSError, ProtocolError) as exc:
        result.failure = "cancelled" if cancel.is_set else f"{type(exc).__name__}: {exc}"
    return result


def _receive(
    sock: socket.socket,
    layout: DiskLayout,
    hashes: list[bytes],
    parent: bytes | None,
    write: Callable[[int, memoryview], None],
    deadline: float,
    result: PullResult,
) -> None:
    key = layout.key
    for index, wanted in enumerate(hashes):
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        kind, payload = recv_frame(sock, layout)
        result.bytes_received += FRAME.size + len(payload)
        if kind is Kind.FAILED:
            result.failure = "the prefill worker: " + payload.decode(errors="replace")
            return
        if kind is Kind.UNKNOWN:
            result.failure = "the prefill worker holds no such room"
            return
        if kind is not Kind.BLOCK:
            result.failure = f"a {kind.name} frame where block {index} belonged"
            return
        block = decode_block(payload, layout, key, wanted)
        if block is None or block.parent_hash != parent:
            result.failure = f"block {index} failed its checks (checksum, layout or hash)"
            return
        write(index, memoryview(block.payload))
        result.loaded.append((wanted, parent, block.token_ids))
        parent = wanted
    kind, _ = recv_frame(sock, layout)
    if kind is not Kind.DONE:
        result.failure = f"a {kind.name} frame where DONE belonged"

"""The KV transfer's wire protocol: a decode worker pulls a prompt's KV blocks
from a prefill worker over TCP (stoker/engine/kv_transfer*.py).

Every message is a frame: kind (1 byte), payload length (4 bytes, little
endian), payload. One pull per connection:

    decode -> prefill   HELLO    {"magic", "version", "layout"} as JSON
    prefill -> decode   HELLO    its own; a layout that differs ends the connection on both sides
    decode -> prefill   PULL     room (u64), index of the first block (u32), count (u32), that many block hashes
    prefill -> decode   BLOCK    one per block asked for, in order: kv_disk_format's encoding (header,
                                 token ids, payload, CRC-32), so each is verified on arrival
                        DONE     every block asked for was sent
                        FAILED   a reason (UTF-8): the rest will not come (the prompt failed, a block it
                                 does not hold, the server busy); the blocks sent before it are good
                        UNKNOWN  no such room within the wait (a room pulled already, or never opened)

Every length the peer sends is bounded before anything is allocated for it
(MAX_PAYLOAD by kind; a BLOCK frame is exactly one block's encoding), and
every read has a socket timeout, so a broken or hostile peer costs one
connection's time, never memory or a hung thread.
"""

from __future__ import annotations

import json
import socket
import struct
from dataclasses import asdict
from enum import IntEnum

from stoker.engine.kv_disk_format import DiskLayout, block_file_bytes

MAGIC = "stoker-kv-transfer"
VERSION = 1
FRAME = struct.Struct("<BI")
PULL = struct.Struct("<QII")
"""room, index of the first block asked for, number of blocks."""
HASH_BYTES = 32
MAX_PULL_BLOCKS = 1 << 16
"""Most blocks one pull asks for: a million tokens at block size 16, far past any context."""
MAX_MESSAGE_BYTES = 4096
"""HELLO and FAILED payloads."""
LAYOUT_FIELDS = {
    "model_digest": "model digest",
    "kv_dtype": "KV dtype",
    "block_size": "block size",
    "block_bytes": "KV block bytes",
    "layout_version": "KV layout version",
}
"""What must match between peers, in the order a mismatch is named (the first explains the rest)."""


class Kind(IntEnum):
    HELLO = 1
    PULL = 2
    BLOCK = 3
    DONE = 4
    FAILED = 5
    UNKNOWN = 6


class ProtocolError(Exception):
    """The peer broke the protocol (a frame of the wrong kind or size, a bad handshake)."""


def layout_dict(layout: DiskLayout) -> dict[str, str | int]:
    return asdict(layout)


def layout_from_dict(fields: dict[str, str | int]) -> DiskLayout:
    return DiskLayout(
        model_digest=str(fields["model_digest"]),
        kv_dtype=str(fields["kv_dtype"]),
        block_size=int(fields["block_size"]),
        block_bytes=int(fields["block_bytes"]),
        layout_version=int(fields["layout_version"]),
    )


def layout_difference(here: DiskLayout, there: DiskLayout) -> str | None:
    """'KV dtype int8 here, bfloat16 there' for the first field that differs; None when none does."""
    mine, theirs = layout_dict(here), layout_dict(there)
    for name, label in LAYOUT_FIELDS.items():
        if mine[name] != theirs[name]:
            return f"{label} {mine[name]} here, {theirs[name]} there"
    return None


def max_payload(kind: Kind, layout: DiskLayout) -> int:
    if kind is Kind.BLOCK:
        return block_file_bytes(layout)
    if kind is Kind.PULL:
        return PULL.size + HASH_BYTES * MAX_PULL_BLOCKS
    if kind in (Kind.DONE, Kind.UNKNOWN):
        return 0
    return MAX_MESSAGE_BYTES


def send_frame(sock: socket.socket, kind: Kind, payload: bytes | bytearray | memoryview = b"") -> int:
    """Bytes put on the wire."""
    sock.sendall(FRAME.pack(kind, len(payload)))
    if payload:
        sock.sendall(payload)
    return FRAME.size + len(payload)


def recv_exact(sock: socket.socket, size: int) -> bytearray:
    data = bytearray(size)
    view = memoryview(data)
    got = 0
    while got < size:
        count = sock.recv_into(view[got:])
        if count == 0:
            raise ConnectionError("the peer closed the connection")
        got += count
    return data


def recv_frame(sock: socket.socket, layout: DiskLayout) -> tuple[Kind, bytearray]:
    kind_value, length = FRAME.unpack(recv_exact(sock, FRAME.size))
    try:
        kind = Kind(kind_value)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind_value}") from None
    if length > max_payload(kind, layout):
        raise ProtocolError(f"a {kind.name} frame of {length} bytes (at most {max_payload(kind, layout)})")
    return kind, recv_exact(sock, length)


def hello_payload(layout: DiskLayout) -> bytes:
    return json.dumps({"magic": MAGIC, "version": VERSION, "layout": layout_dict(layout)}).encode()


def parse_hello(kind: Kind, payload: bytearray) -> DiskLayout:
    """The peer's layout from its HELLO; ProtocolError when it is no stoker KV transfer peer."""
    if kind is not Kind.HELLO:
        raise ProtocolError(f"expected HELLO, got {kind.name}")
    try:
        hello = json.loads(payload)
        if hello.get("magic") != MAGIC:
            raise ProtocolError("not a stoker KV transfer server")
        if hello.get("version") != VERSION:
            raise ProtocolError(f"KV transfer protocol version {VERSION} here, {hello.get('version')} there")
        return layout_from_dict(hello["layout"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ProtocolError(f"a malformed HELLO ({exc})") from None


def pull_payload(room: int, first_index: int, hashes: list[bytes]) -> bytes:
    return PULL.pack(room, first_index, len(hashes)) + b"".join(hashes)


def parse_pull(kind: Kind, payload: bytearray) -> tuple[int, int, list[bytes]]:
    if kind is not Kind.PULL:
        raise ProtocolError(f"expected PULL, got {kind.name}")
    if len(payload) < PULL.size:
        raise ProtocolError("a short PULL")
    room, first_index, count = PULL.unpack_from(payload)
    if count > MAX_PULL_BLOCKS or len(payload) != PULL.size + HASH_BYTES * count:
        raise ProtocolError(f"a PULL of {count} blocks in {len(payload)} bytes")
    hashes = [bytes(payload[PULL.size + i * HASH_BYTES : PULL.size + (i + 1) * HASH_BYTES]) for i in range(count)]
    return room, first_index, hashes

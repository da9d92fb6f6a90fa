"""The disk tier's block file (stoker/engine/kv_disk.py keeps them): one file per full KV block.

    header   magic "STKV", format version, layout key, block hash, parent hash,
             number of tokens, payload length (HEADER below, little endian)
    tokens   the block's token ids, int64 each
    payload  K and V of every layer for the block, the cache's own bytes
    crc32    of everything before it (zlib)

CRC-32 rather than a cryptographic digest: it guards against torn and
flipped bytes (a crash, a bad disk), which it catches at memory speed; it
cannot guard against someone who may write to DIR, and neither could an
unkeyed SHA-256 (they would write a matching one). A file is served only if
its length, checksum, layout key and block hash match, and the block hash is
the chained hash of (parent hash, tokens).
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from dataclasses import asdict, dataclass

from stoker.engine.kv_cache import chain_hash

LAYOUT_VERSION = 1
"""Bump when the KV tensors' layout changes (row format, order of layers), so old files stop matching."""
FORMAT_VERSION = 1
MAGIC = b"STKV"
HEADER = struct.Struct("<4sHH32s32s32sIQ")
"""magic, format version, flags (bit 0: has a parent), layout key, block hash, parent hash, tokens, payload bytes."""
CHECKSUM = struct.Struct("<I")


@dataclass(frozen=True)
class DiskLayout:
    """Everything that makes a block's bytes valid besides its tokens."""

    model_digest: str
    kv_dtype: str
    block_size: int
    block_bytes: int
    layout_version: int = LAYOUT_VERSION

    @property
    def key(self) -> bytes:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).digest()


def block_file_bytes(layout: DiskLayout) -> int:
    """Size of one block's file: header, token ids, payload, checksum."""
    return HEADER.size + 8 * layout.block_size + layout.block_bytes + CHECKSUM.size


@dataclass(frozen=True)
class StoredBlock:
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    payload: bytes | bytearray | memoryview
    """K and V of every layer, layout.block_bytes; read blocks hold a writable view (torch.frombuffer takes it)."""


def decode_block(data: bytearray, layout: DiskLayout, layout_key: bytes, block_hash: bytes) -> StoredBlock | None:
    """The block a file holds; None unless every check passes."""
    if len(data) < HEADER.size + CHECKSUM.size:
        return None
    magic, version, flags, key, stored_hash, parent, num_tokens, payload_len = HEADER.unpack_from(data)
    tokens_end = HEADER.size + 8 * num_tokens
    if (
        magic != MAGIC
        or version != FORMAT_VERSION
        or key != layout_key
        or stored_hash != block_hash
        or num_tokens != layout.block_size
        or payload_len != layout.block_bytes
        or len(data) != tokens_end + payload_len + CHECKSUM.size
        or CHECKSUM.unpack_from(data, len(data) - CHECKSUM.size)[0] != zlib.crc32(memoryview(data)[:-4])
    ):
        return None
    tokens = tuple(struct.unpack_from(f"<{num_tokens}q", data, HEADER.size))
    parent_hash = parent if flags & 1 else None
    if chain_hash(parent_hash, tokens) != block_hash:
        return None
    return StoredBlock(block_hash, parent_hash, tokens, memoryview(data)[tokens_end : tokens_end + payload_len])


def encode_block(layout_key: bytes, block: StoredBlock) -> bytes:
    header = HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        1 if block.parent_hash is not None else 0,
        layout_key,
        block.block_hash,
        block.parent_hash or bytes(32),
        len(block.token_ids),
        len(block.payload),
    )
    body = header + struct.pack(f"<{len(block.token_ids)}q", *block.token_ids) + bytes(block.payload)
    return body + CHECKSUM.pack(zlib.crc32(body))

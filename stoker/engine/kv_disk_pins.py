"""Pinned prefixes of the disk tier: one JSON file per label under <layout folder>/pins/,
written atomically, read by every process sharing the folder; their blocks are never evicted."""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
TEMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class PinnedPrefix:
    label: str
    num_tokens: int
    num_blocks: int
    created: float
    """Unix time of the pin."""
    blocks_on_disk: int


@dataclass(frozen=True)
class PinRecord:
    label: str
    num_tokens: int
    created: float
    block_hashes: list[bytes]


class PinFolder:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(mode=0o700, exist_ok=True)

    def path(self, label: str) -> Path:
        if not LABEL.match(label):
            raise ValueError(f"pin label {label!r}: 1 to 64 characters of letters, digits, '.', '_', '-'")
        return self.folder / f"{label}.json"

    def write(self, label: str, block_hashes: Sequence[bytes], num_tokens: int) -> None:
        path = self.path(label)
        record = {
            "label": label,
            "num_tokens": num_tokens,
            "created": time.time(),
            "block_hashes": [h.hex() for h in block_hashes],
        }
        temp = path.with_name(f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
        temp.write_text(json.dumps(record))
        os.replace(temp, path)

    def remove(self, label: str) -> bool:
        try:
            self.path(label).unlink()
        except FileNotFoundError:
            return False
        return True

    def records(self) -> list[PinRecord]:
        out = []
        try:
            paths = sorted(self.folder.glob("*.json"))
        except OSError:
            return []
        for path in paths:
            try:
                record = json.loads(path.read_text())
                out.append(
                    PinRecord(
                        str(record["label"]),
                        int(record["num_tokens"]),
                        float(record["created"]),
                        [bytes.fromhex(h) for h in record["block_hashes"]],
                    )
                )
            except (OSError, ValueError, KeyError, TypeError):
                continue  # deleted meanwhile, or not a pin file
        return out

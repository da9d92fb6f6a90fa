"""Pinned prefixes: a prompt prefix computed once and kept in the disk tier
whatever its LRU says (issue 36 item 4; docs/prefix-cache.md).

The front end sends a PrefixCommand (pin, unpin or list) and awaits the
PrefixAnswer with the same ticket, as a prefix-cache reset travels. A pin runs
as a prompt-only request (one greedy token, dropped) through the ordinary
scheduler, so it waits its turn and never stalls other requests' decode; the
scheduler caches its full blocks and the disk tier writes them as the request
finishes. When it finishes, the chained hashes of those full blocks are pinned
in the store: the same hashes a later prompt that starts with the prefix
looks up, block by block. A partial last block is not pinned (it has no hash).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from stoker.engine.kv_cache import chain_hash
from stoker.engine.kv_disk import LABEL, DiskBlockStore, PinnedPrefix
from stoker.engine.params import EngineCoreOutput, EngineCoreRequest, FinishReason, SamplingParams

PIN_LABEL_PATTERN = LABEL.pattern
"""What a label may be: the store names its pin file after it."""
LABEL_RULE = "1 to 64 characters of letters, digits, '.', '_' and '-', starting with a letter or digit"
PIN_REQUEST_PREFIX = "__pin__/"
"""Engine request ids of pins; the front end's ids are UUID-based and never start so."""
NO_DISK_TIER = "this model has no disk tier: pinning needs the server started with --kv-cache-disk DIR"


@dataclass
class PrefixCommand:
    ticket: int
    action: Literal["pin", "unpin", "list"]
    label: str = ""
    token_ids: list[int] = field(default_factory=list)
    """The prefix to pin (action pin)."""


@dataclass
class PrefixAnswer:
    ticket: int
    pins: list[PinnedPrefix] = field(default_factory=list)
    """pin: the new pin; list: every pin of this model's layout; unpin: empty."""
    removed: bool = False
    """unpin: whether the label was pinned."""
    error: str | None = None
    """Why the command failed (the prefix is refused, no disk tier); None when it worked."""


def block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """The chained hashes of the full blocks of token_ids, as the prefix cache keys them."""
    hashes: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, tuple(token_ids[start : start + block_size]))
        hashes.append(parent)
    return hashes


class PrefixPins:
    """The engine core's side of pinning: runs pins as requests, answers commands."""

    def __init__(self, store: DiskBlockStore | None, block_size: int) -> None:
        self.store = store
        self.block_size = block_size
        self._running: dict[str, PrefixCommand] = {}
        """Pins whose prefix is being computed, by engine request id."""
        self._answers: list[PrefixAnswer] = []

    def handle(self, command: PrefixCommand) -> EngineCoreRequest | None:
        """Answer a list or unpin at once; for a pin, the request the core must add
        (then settle() answers once it finishes, or refused() if the core refuses it)."""
        if self.store is None:
            self._answers.append(PrefixAnswer(command.ticket, error=NO_DISK_TIER))
            return None
        if command.action == "list":
            self._answers.append(PrefixAnswer(command.ticket, pins=self.store.pins()))
            return None
        if not LABEL.match(command.label):
            self._answers.append(PrefixAnswer(command.ticket, error=f"label {command.label!r}: {LABEL_RULE}"))
            return None
        if command.action == "unpin":
            try:
                self._answers.append(PrefixAnswer(command.ticket, removed=self.store.unpin(command.label)))
            except OSError as exc:  # a read-only folder
                self._answers.append(PrefixAnswer(command.ticket, error=f"the pin cannot be removed: {exc}"))
            return None
        if len(command.token_ids) < self.block_size:
            self._answers.append(
                PrefixAnswer(
                    command.ticket,
                    error=f"the prefix is {len(command.token_ids)} tokens: a pin holds whole KV blocks, "
                    f"at least {self.block_size} tokens (--block-size)",
                )
            )
            return None
        request_id = f"{PIN_REQUEST_PREFIX}{command.ticket}"
        self._running[request_id] = command
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=list(command.token_ids),
            sampling_params=SamplingParams(max_tokens=1, temperature=0.0),
            arrival_time=time.time(),
        )

    def refused(self, request: EngineCoreRequest, reason: str) -> None:
        """The core refused a pin's request (too long for the context or the cache)."""
        command = self._running.pop(request.request_id)
        self._answers.append(PrefixAnswer(command.ticket, error=reason))

    def settle(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """outputs without those of pins; a pin whose request finished is pinned and answered."""
        if not self._running:
            return outputs
        kept = []
        for output in outputs:
            command = self._running.get(output.request_id)
            if command is None:
                kept.append(output)
                continue
            if not output.finished:
                continue
            del self._running[output.request_id]
            if output.finish_reason is FinishReason.ABORT:
                self._answers.append(PrefixAnswer(command.ticket, error=output.error or "the pin was aborted"))
                continue
            assert self.store is not None  # handle() runs no pin without one
            hashes = block_hashes(command.token_ids, self.block_size)
            try:
                self.store.pin(command.label, hashes, len(command.token_ids))
            except OSError as exc:  # the pin file cannot be written: the disk is full or read-only
                self._answers.append(PrefixAnswer(command.ticket, error=f"the pin cannot be saved: {exc}"))
                continue
            pinned = next(p for p in self.store.pins() if p.label == command.label)
            self._answers.append(PrefixAnswer(command.ticket, pins=[pinned]))
        return kept

    def take_answers(self) -> list[PrefixAnswer]:
        answers, self._answers = self._answers, []
        return answers

"""Responses kept in memory for previous_response_id and GET/DELETE
/v1/responses/{id}, per server process (a replica behind a router knows only
its own; see docs/server.md).

Keys are kept apart. An entry is filed under its owner (the id of the API key
that made it; None in open mode, one owner for everyone) and the server's own
response id (`resp_<server request id>`, never anything a client chose):
another key neither sees, continues, overwrites nor deletes it, as with
OpenAI's per-project storage, and asking for it reads as asking for an id
that does not exist.

Three bounds keep the memory bounded whatever clients send:
- per_key: entries one owner holds; past it the owner's own least recently
  used entry goes, never another owner's;
- capacity: entries in all; past it an entry of the owner holding the most
  goes (its least recently used), so a key keeping few is the last to lose any;
- max_entry_bytes: one entry's size as JSON (the response and its
  conversation); a bigger one is not kept. The store so holds at most
  capacity x max_entry_bytes of JSON.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from stoker.server.strict_json import dumps

ENTRY_BYTES = 256 * 1024
"""Default bound on one stored response (--responses-store-entry-bytes)."""


@dataclass
class StoredResponse:
    response: dict[str, Any]
    """The Response object as it was answered."""
    conversation: list[dict[str, Any]]
    """Its input and output as chat messages, without its instructions: what
    a response that continues it puts before its own input (OpenAI does not
    carry instructions over)."""
    owner: str | None
    """The id of the API key that made it; None in open mode."""


def entry_bytes(response: dict[str, Any], conversation: list[dict[str, Any]]) -> int:
    """What an entry weighs against max_entry_bytes: its JSON, in UTF-8 bytes."""
    return len(dumps([response, conversation]).encode())


class ResponseStore:
    def __init__(self, capacity: int, per_key: int | None = None, max_entry_bytes: int = ENTRY_BYTES) -> None:
        self.capacity = capacity
        self.per_key = capacity if per_key is None else min(per_key, capacity)
        self.max_entry_bytes = max_entry_bytes
        self._owners: dict[str | None, OrderedDict[str, StoredResponse]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def held_by(self, owner: str | None) -> int:
        """Entries owner holds now."""
        return len(self._owners.get(owner, ()))

    def fits(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Whether an entry of this response and conversation may be kept."""
        return self.enabled and entry_bytes(response, conversation) <= self.max_entry_bytes

    def put(self, entry: StoredResponse) -> bool:
        """Keep entry under its owner, unless it is over max_entry_bytes (or the
        store is off); then evict beyond the bounds. True if kept."""
        if not self.fits(entry.response, entry.conversation):
            return False
        own = self._owners.setdefault(entry.owner, OrderedDict())
        response_id = entry.response["id"]
        if response_id not in own:
            self._count += 1
        own[response_id] = entry
        own.move_to_end(response_id)
        while len(own) > self.per_key:
            self._evict(entry.owner)
        while self._count > self.capacity:
            # The biggest holder gives up its least recently used entry (among
            # equals, the owner that has held entries longest): a key cannot
            # push out another's while it keeps more than that key.
            self._evict(max(self._owners, key=lambda owner: len(self._owners[owner])))
        return True

    def _evict(self, owner: str | None) -> None:
        own = self._owners[owner]
        own.popitem(last=False)
        self._count -= 1
        if not own:
            del self._owners[owner]

    def get(self, response_id: str, owner: str | None) -> StoredResponse | None:
        """owner's entry of that id (now its most recently used), else None,
        whether the id is unknown or another owner's."""
        own = self._owners.get(owner)
        entry = own.get(response_id) if own is not None else None
        if own is None or entry is None:
            return None
        own.move_to_end(response_id)
        return entry

    def delete(self, response_id: str, owner: str | None) -> bool:
        """Forget owner's entry of that id; False if owner has none (another
        owner's entry of that id, were there one, stays)."""
        if self.get(response_id, owner) is None:
            return False
        self._owners[owner].pop(response_id)
        self._count -= 1
        if not self._owners[owner]:
            del self._owners[owner]
        return True


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat turn they were: the assistant's
    text and its function calls in one message."""
    text = "".join(
        part["text"] for item in output if item["type"] == "message" for part in item["content"] if "text" in part
    )
    calls = [
        {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in output
        if item["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    elif not text:
        message["content"] = ""
    thinking = "".join(
        part["text"] for item in output if item["type"] == "reasoning" for part in item.get("content") or []
    )
    if thinking:  # a thinking model's template may show it again (Qwen3's does within one query)
        message["reasoning_content"] = thinking
    return [message]

"""Responses kept in memory for previous_response_id and GET/DELETE
/v1/responses/{id}: the newest --responses-store-size of them, per server
process (a replica behind a router knows only its own; see docs/server.md).

Each entry remembers the key that made it: another key (or no key) neither
sees nor continues it, as with OpenAI's per-project storage.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


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


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def put(self, entry: StoredResponse) -> None:
        """Keep entry, forgetting the least recently used beyond capacity."""
        if not self.enabled:
            return
        self._entries[entry.response["id"]] = entry
        self._entries.move_to_end(entry.response["id"])
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str, owner: str | None) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str, owner: str | None) -> bool:
        if self.get(response_id, owner) is None:
            return False
        del self._entries[response_id]
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
    return [message]

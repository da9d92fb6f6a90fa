"""Waiting-request queues behind one interface: the policy is the sort key."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator

from stoker.engine.request import Request

# Keys are numbers (priority, deadline, arrival time, arrival order), compared in order.
SortKey = Callable[[Request], tuple[float, ...]]


def fcfs_key(request: Request) -> tuple[float, ...]:
    return (request.arrival_time, request.arrival_seq)


def priority_key(request: Request) -> tuple[float, ...]:
    return request.sort_key()


def fcfs_victim_key(request: Request) -> tuple[float, ...]:
    return fcfs_key(request)


def priority_victim_key(request: Request) -> tuple[float, ...]:
    """Preemption picks the lowest class, then the latest arrival (deadlines order
    the queue but do not make a running request a victim)."""
    return (request.priority, request.arrival_time, request.arrival_seq)


class RequestQueue:
    """Requests kept in service order; a preempted request goes back in its
    place (by its original arrival), not at the tail."""

    def __init__(self, key: SortKey) -> None:
        self._key = key
        self._keys: list[tuple[float, ...]] = []
        self._items: list[Request] = []

    def add(self, request: Request) -> None:
        k = self._key(request)
        i = bisect.bisect_right(self._keys, k)
        self._keys.insert(i, k)
        self._items.insert(i, request)

    def remove(self, request: Request) -> None:
        k = self._key(request)
        i = bisect.bisect_left(self._keys, k)
        while i < len(self._items) and self._items[i] is not request:
            i += 1
        if i == len(self._items):
            raise ValueError(f"request {request.request_id!r} is not in this queue")
        del self._keys[i]
        del self._items[i]

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)


POLICIES: dict[str, tuple[SortKey, SortKey]] = {
    # policy: (service order, key whose maximum is the preemption victim)
    "fcfs": (fcfs_key, fcfs_victim_key),
    "priority": (priority_key, priority_victim_key),
}


def make_queue(policy: str) -> RequestQueue:
    if policy not in POLICIES:
        raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {policy!r}")
    return RequestQueue(POLICIES[policy][0])

"""Waiting queues: FCFS and priority/deadline order, stable ties, preempted
requests back in their place, removal by identity."""

from __future__ import annotations

import pytest

from stoker.engine.params import SamplingParams
from stoker.engine.queues import RequestQueue, fcfs_key, make_queue, priority_key
from stoker.engine.request import Request


def req(
    rid: str,
    arrival: float,
    priority: int = 0,
    deadline: float | None = None,
    seq: int = 0,
    index: int = 0,
) -> Request:
    r = Request(rid, index, [1, 2, 3], SamplingParams(), arrival, priority=priority, deadline=deadline)
    r.arrival_seq = seq
    return r


def ids(q: RequestQueue) -> list[str]:
    return [r.request_id for r in q]


def test_fcfs_orders_by_arrival_and_ignores_priority_and_deadline() -> None:
    q = make_queue("fcfs")
    q.add(req("c", 3.0, priority=0, deadline=1.0, seq=2))
    q.add(req("a", 1.0, priority=5, seq=0))
    q.add(req("d", 4.0, priority=-1, seq=3))
    q.add(req("b", 2.0, priority=9, deadline=0.5, seq=1))
    assert ids(q) == ["a", "b", "c", "d"]


def test_fcfs_same_arrival_time_breaks_ties_by_arrival_seq() -> None:
    q = make_queue("fcfs")
    q.add(req("second", 1.0, seq=2))
    q.add(req("first", 1.0, seq=1))
    q.add(req("third", 1.0, seq=3))
    assert ids(q) == ["first", "second", "third"]


def test_equal_keys_keep_insertion_order() -> None:
    q = make_queue("fcfs")
    for name in ("x", "y", "z"):
        q.add(req(name, 1.0, seq=0))
    assert ids(q) == ["x", "y", "z"]


def test_priority_orders_by_priority_then_deadline_then_arrival() -> None:
    q = make_queue("priority")
    q.add(req("p1-early", 0.0, priority=1, seq=0))
    q.add(req("p0-nodeadline-early", 1.0, priority=0, seq=1))
    q.add(req("p0-deadline-late", 2.0, priority=0, deadline=100.0, seq=2))
    q.add(req("p0-deadline-soon", 3.0, priority=0, deadline=50.0, seq=3))
    q.add(req("p0-nodeadline-late", 4.0, priority=0, seq=4))
    q.add(req("pneg", 5.0, priority=-1, seq=5))
    q.add(req("p0-deadline-soon-2", 6.0, priority=0, deadline=50.0, seq=6))
    assert ids(q) == [
        "pneg",
        "p0-deadline-soon",
        "p0-deadline-soon-2",
        "p0-deadline-late",
        "p0-nodeadline-early",
        "p0-nodeadline-late",
        "p1-early",
    ]


def test_keys_match_request_sort_key() -> None:
    r = req("r", 2.0, priority=3, deadline=9.0, seq=7)
    assert priority_key(r) == (3, 9.0, 2.0, 7) == r.sort_key()
    assert fcfs_key(r) == (2.0, 7)
    assert req("n", 1.0).sort_key() == (0, float("inf"), 1.0, 0)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_readded_preempted_request_goes_back_in_its_original_place(policy: str) -> None:
    q = make_queue(policy)
    a, b, c = req("a", 0.0, seq=0), req("b", 1.0, seq=1), req("c", 2.0, seq=2)
    for r in (a, b, c):
        q.add(r)
    q.remove(a)  # scheduled
    q.add(req("d", 3.0, seq=3))
    q.add(a)  # preempted: back at the front, not behind d
    assert ids(q) == ["a", "b", "c", "d"]
    q.remove(b)
    q.add(b)
    assert ids(q) == ["a", "b", "c", "d"]


def test_remove_with_identical_keys_removes_that_object() -> None:
    q = make_queue("priority")
    x, y, z = (req("same", 1.0, seq=0, index=i) for i in range(3))
    for r in (x, y, z):
        q.add(r)
    q.remove(y)
    assert [r.index for r in q] == [0, 2]
    first, second = list(q)
    assert first is x and second is z
    q.remove(z)
    assert list(q) == [x]
    q.remove(x)
    assert len(q) == 0 and not q


def test_remove_among_neighbours_with_other_keys() -> None:
    q = make_queue("fcfs")
    rs = [req(str(i), float(i // 2), seq=0, index=i) for i in range(6)]  # pairs share keys
    for r in rs:
        q.add(r)
    q.remove(rs[3])
    q.remove(rs[0])
    assert [r.index for r in q] == [1, 2, 4, 5]


def test_iteration_is_a_snapshot() -> None:
    q = make_queue("fcfs")
    a, b = req("a", 0.0), req("b", 1.0)
    q.add(a)
    q.add(b)
    seen = []
    for r in q:
        seen.append(r.request_id)
        q.remove(r)
        if r is a:
            q.add(req("late", 5.0))
    assert seen == ["a", "b"]
    assert ids(q) == ["late"]


def test_len_bool_peek() -> None:
    q = make_queue("priority")
    assert len(q) == 0 and not q
    q.add(req("b", 1.0, priority=1))
    q.add(req("a", 2.0, priority=0))
    assert len(q) == 2 and q
    assert ids(q)[0] == "a"


def test_unknown_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match="scheduling_policy"):
        make_queue("lifo")

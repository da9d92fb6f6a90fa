"""The engine process's own housekeeping, apart from what it serves."""

from __future__ import annotations

import gc

import zmq

from stoker.engine.process import _loop, freeze_loaded_objects


def test_loaded_objects_leave_the_collectors_generations() -> None:
    """After warm-up the engine freezes what it loaded, so the full collections
    a decode loop triggers walk only what the loop itself allocates."""
    loaded = [[index] for index in range(100)]  # lists: tracked by the collector
    assert any(o is loaded[0] for o in gc.get_objects())
    try:
        freeze_loaded_objects()
        assert gc.get_freeze_count() >= len(loaded)
        assert not any(o is loaded[0] for o in gc.get_objects())  # no generation holds it now
    finally:
        gc.unfreeze()
    assert any(o is loaded[0] for o in gc.get_objects())


def test_row_costs_are_measured_at_the_first_idle_poll() -> None:
    """The engine loop runs EngineCore's row-cost calibration once, when it
    first finds nothing to do, not before it reports ready. (A parent pid that
    is not ours makes the loop return at that same idle poll, as an orphan.)"""
    ctx = zmq.Context()
    try:
        inp, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        inp.bind("inproc://engine-in")
        out.bind("inproc://engine-out")

        class IdleCore:
            def has_unfinished_requests(self) -> bool:
                return False

        calls: list[str] = []
        _loop(IdleCore(), inp, out, parent_pid=-1, calibrate=lambda: calls.append("measured"))
        assert calls == ["measured"]
    finally:
        ctx.destroy(linger=0)

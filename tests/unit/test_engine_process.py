"""The engine process's own housekeeping, apart from what it serves."""

from __future__ import annotations

import gc

from stoker.engine.process import freeze_loaded_objects


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

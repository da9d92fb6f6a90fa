"""Weights repacked for the GEMM after the model serves, not before it can.

Repacking (csrc/packed_panels.h) reads every Q4_K, Q6_K, Q8_0, Q5_0 and Q4_0 weight and
writes a copy: ~0.25 s for a 1B model, 4-10 s for an 8B one, most of it the
copy's first-touch page faults, and all of it from disk when the file is not
in the page cache. Done at load, it took an 8B's start to ready from 3 s to
11-43 s. So the model is built on its blocks and a thread repacks them, one
linear layer at a time, while the engine serves: the packed products are the
blocks' bit for bit, so which of the two a step reads changes no output, only
its speed.

A finished layer is installed under the model's weights lock, which a forward
pass holds: its blocks' mapped pages are given back as it swaps, so no product
may be reading them then.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

from stoker.models.quant.weights import GGMLLinear

log = logging.getLogger("stoker.models.quant")

# One thread: the other cores keep serving while it runs.
REPACK_THREADS = 1


class BackgroundRepack:
    """Repacks `linears` (deferred_packing's list) on a thread of its own,
    installing each under `lock` and then telling `on_installed`."""

    def __init__(
        self,
        linears: Sequence[GGMLLinear],
        lock: AbstractContextManager[object],
        on_installed: Callable[[GGMLLinear], None],
    ) -> None:
        self._linears = list(linears)
        self._lock = lock
        self._on_installed = on_installed
        self._thread: threading.Thread | None = None
        self._kept: list[object] = []
        self._stopping = threading.Event()

    @property
    def pending(self) -> bool:
        """Whether some layer still serves blocks it will serve from panels."""
        return bool(self._linears) and (self._thread is None or self._thread.is_alive())

    def start(self) -> None:
        if self._thread is None and self._linears:
            self._thread = threading.Thread(target=self._run, name="stoker-repack", daemon=True)
            # A process that exits while the thread is inside torch or the packer aborted
            # ("terminate called without an active exception", 1 exit in 4 of a 0.5B model
            # loaded and left at once): at exit it stops between two layers and is waited for.
            atexit.register(self.stop)
            self._thread.start()

    def stop(self) -> None:
        """Stop between two layers and wait for the thread: the layers not reached keep
        serving their blocks (the same outputs)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()

    def finish(self) -> None:
        """Return once every layer serves from its panels (started here if it was not):
        for a caller that wants the packed speed from its first step."""
        self.start()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        started = time.perf_counter()
        done = 0
        try:
            for linear in self._linears:
                if self._stopping.is_set():
                    log.info("repacking weights for the GEMM stopped after %d layers: the process exits", done)
                    return
                copies = linear.packed_copies(REPACK_THREADS)
                with self._lock:
                    replaced = linear.install_packed(copies)
                    try:
                        self._on_installed(linear)
                    except RuntimeError:
                        self._kept.append(replaced)  # what still points at these blocks keeps them
                        raise
                done += 1
        except (MemoryError, RuntimeError) as exc:
            # The blocks keep serving, with the same outputs: only the panels' speed is lost.
            log.warning("repacking weights for the GEMM stopped after %d layers: %s", done, exc)
            return
        finally:
            atexit.unregister(self.stop)
        log.info(
            "weights repacked for the GEMM: %d linear layers in %.1f s, in the background",
            done,
            time.perf_counter() - started,
        )

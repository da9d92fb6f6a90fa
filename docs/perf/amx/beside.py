"""A process beside a benchmark that takes a core in short bursts, as a front
end streaming tokens does: 2 ms busy every 20 ms, until killed.

    python docs/perf/amx/beside.py & python docs/perf/amx/step_time.py GGUF 64; kill %1
"""

from __future__ import annotations

import time

BUSY_S, PERIOD_S = 0.002, 0.020


def main() -> None:
    while True:
        start = time.perf_counter()
        while time.perf_counter() - start < BUSY_S:
            pass
        time.sleep(PERIOD_S - BUSY_S)


if __name__ == "__main__":
    main()

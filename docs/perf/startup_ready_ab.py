"""Launch to the first 200 on /ready, two trees alternating (docs/perf/startup.md).

    python docs/perf/startup_ready_ab.py MODEL ROUNDS TREE_A TREE_B [--cold]

MODEL is a GGUF (served with the ladder's flags) or `default` (the default
model with default flags). Each tree starts once unmeasured first (its kernel
builds, the page cache, the digest cache), then ROUNDS rounds, the order
reversed every other round. --cold drops the file's pages before every start
(posix_fadvise DONTNEED: no root needed) and times a cold read of the file
once a round, the same way. Each server gets its own key database; runs from
/tmp so that `python -m` imports the tree given as the working directory.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

LADDER_FLAGS = ["--no-embedding-model", "--max-num-seqs", "16", "--max-model-len", "2056"]
LADDER_FLAGS += ["--kv-cache-tokens", "6912", "--num-threads", "2", "--host", "127.0.0.1"]


def drop_pages(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cold_read_seconds(path: str) -> float:
    drop_pages(path)
    started = time.monotonic()
    with open(path, "rb", buffering=0) as f:
        while f.read(16 << 20):
            pass
    return time.monotonic() - started


def start_to_ready(tree: str, model: str, port: int, cold: bool) -> float:
    args = ["serve", "--port", str(port)] + ([] if model == "default" else ["--model", model, *LADDER_FLAGS])
    env = {**os.environ, "STOKER_DB": f"/tmp/startup-ab-{port}.db"}
    if cold:
        drop_pages(model)
    started = time.monotonic()
    server = subprocess.Popen(
        [sys.executable, "-m", "stoker.cli", *args],
        cwd=tree,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        while True:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1).status == 200:
                    return time.monotonic() - started
            except OSError:
                pass
            if server.poll() is not None:
                raise SystemExit(f"{tree}: the server exited with {server.returncode}")
            time.sleep(0.02)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)
        time.sleep(1)


def main() -> None:
    model, rounds, trees, cold = sys.argv[1], int(sys.argv[2]), sys.argv[3:5], "--cold" in sys.argv[5:]
    if cold and model == "default":
        raise SystemExit("--cold needs a model file")
    os.chdir("/tmp")
    seconds: dict[str, list[float]] = {tree: [] for tree in trees}
    reads: list[float] = []
    for round_ in range(-1, rounds):  # round -1 is not measured
        if cold and round_ >= 0:
            reads.append(cold_read_seconds(model))
        order = trees if round_ % 2 == 0 else trees[::-1]
        for slot, tree in enumerate(order):
            took = start_to_ready(tree, model, 8811 + slot, cold)
            if round_ >= 0:
                seconds[tree].append(took)
    if reads:
        print(
            f"cold read of the file: median {statistics.median(reads):.2f} s, all {' '.join(f'{r:.2f}' for r in reads)}"
        )
    for tree, each in seconds.items():
        print(f"{tree}: median {statistics.median(each):.2f} s, all {' '.join(f'{t:.2f}' for t in each)}")


if __name__ == "__main__":
    main()

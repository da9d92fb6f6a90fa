"""Idle sleep on the default model: resident memory of the engine process and
of the server with its children, awake and asleep, and the time to first
token of a request to the model awake against one that wakes it; alternated
CYCLES times in one run, then the server's own wake histogram.

    .venv/bin/python docs/perf/sleep/idle_sleep.py [CYCLES]

It starts `stoker serve --sleep-idle-seconds 3 --no-embedding-model` on a free
port with a fresh key database (an admin key, for /admin/models and /metrics).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import psutil

from stoker.bench.server_ready import wait_until_ready
from stoker.control.db import open_db
from stoker.control.keys import KeyStore

CHAT = {"messages": [{"role": "user", "content": "Tell me about ships."}], "max_tokens": 8, "temperature": 0}


def main(cycles: int) -> None:
    tmp = tempfile.mkdtemp(prefix="stoker-sleep-")
    db = os.path.join(tmp, "keys.db")
    headers = {"Authorization": "Bearer " + KeyStore(open_db(db)).create("root", admin=True)[1]}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    args = ["serve", "--port", str(port), "--no-embedding-model", "--sleep-idle-seconds", "3"]
    with open(os.path.join(tmp, "server.log"), "wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "stoker.cli", *args], stdout=log, stderr=log, env={**os.environ, "STOKER_DB": db}
        )

    def stable() -> dict:
        return httpx.get(f"{url}/admin/models", headers=headers, timeout=30).json()["data"][0]["stable"]

    def rss_total() -> int:
        proc = psutil.Process(server.pid)
        return proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))

    def ttft() -> float:
        started = time.perf_counter()
        body = {**CHAT, "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and '"content":"' in line:
                    return time.perf_counter() - started
        raise RuntimeError("no token came")

    def asleep() -> None:
        while not ((s := stable())["sleeping"] and s["engine_pid"] is None):
            time.sleep(0.05)
        time.sleep(0.5)

    try:
        why = wait_until_ready(url, server, 600, interval=0.2)
        if why is not None:
            raise RuntimeError(f"stoker serve {why}; see {os.path.join(tmp, 'server.log')}")
        ttft()  # the first request of a fresh engine
        for cycle in range(cycles):
            awake = ttft()
            engine = psutil.Process(stable()["engine_pid"]).memory_info().rss
            total_awake = rss_total()
            asleep()
            total_asleep = rss_total()
            woken = ttft()
            row = {"cycle": cycle, "ttft_awake_s": awake, "ttft_waking_s": woken, "engine_rss_mb": engine / 1e6}
            row |= {"server_total_rss_awake_mb": total_awake / 1e6, "server_total_rss_asleep_mb": total_asleep / 1e6}
            print(json.dumps({k: round(v, 3) for k, v in row.items()}), flush=True)
        time.sleep(0.6)  # the metrics feed runs every 0.25 s
        for line in httpx.get(f"{url}/metrics", headers=headers, timeout=30).text.splitlines():
            if line.startswith(("stoker:model_wake_seconds_sum", "stoker:model_wake_seconds_count")):
                print(line)
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)

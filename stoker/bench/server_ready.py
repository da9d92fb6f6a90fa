"""Waiting for a server started as a child process: its /ready (or another path)
polled until it answers 200, the child's exit or the deadline ending the wait. The
benches that start servers (stoker, llama-server, vLLM, sglang-router) and the
tests' server fixture all wait this way."""

from __future__ import annotations

import subprocess
import time

import httpx


def wait_until_ready(
    url: str,
    proc: subprocess.Popen[bytes],
    timeout: float,
    interval: float,
    path: str = "/ready",
    headers: dict[str, str] | None = None,
) -> str | None:
    """None once GET url + path (with headers) answers 200; else why it never will: "exited with CODE"
    or "not ready in T s". The caller raises its own error with its own log."""
    deadline = time.monotonic() + timeout
    # One client for every poll: httpx.get builds a client, and with it an SSL context, each
    # call (~22 ms of CPU), which at a 20 ms interval took half a core from the server starting.
    with httpx.Client(headers=headers, timeout=2) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return f"exited with {proc.returncode}"
            try:
                if client.get(url + path).status_code == 200:
                    return None
            except httpx.HTTPError:
                pass
            time.sleep(interval)
    return f"not ready in {timeout:g} s"

"""ZeroMQ addresses a stoker socket binds (the KV events publisher and its replay
socket): the forms the config accepts, and which of them only this machine reaches.
Below the engine and the config both, so each checks the same way."""

from __future__ import annotations

import re

LOOPBACK = "127.0.0.1"

_PORT_ONLY = re.compile(r"^(tcp://:?)?(\d{1,5})$")
_ENDPOINT = re.compile(r"^(tcp://(\*|[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]):(\d{1,5})|ipc://.+|inproc://.+)$")
_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "[::1]"}


def check_endpoint(endpoint: str) -> str:
    """The ZeroMQ address to bind, or ValueError (one line) unless endpoint is one:
    a port alone (PORT, tcp://:PORT), bound on 127.0.0.1; tcp://HOST:PORT (HOST *
    for every interface), ipc://PATH or inproc://NAME."""
    port_only = _PORT_ONLY.match(endpoint)
    if port_only is not None:
        endpoint = f"tcp://{LOOPBACK}:{port_only.group(2)}"
    match = _ENDPOINT.match(endpoint)
    if match is None:
        raise ValueError(
            "must be a ZeroMQ address to bind: PORT (on 127.0.0.1), tcp://HOST:PORT, tcp://*:PORT or ipc://PATH"
        )
    if match.group(3) is not None and not 1 <= int(match.group(3)) <= 65535:
        raise ValueError("the port must be between 1 and 65535")
    return endpoint


def is_local(endpoint: str) -> bool:
    """Whether only this machine can reach endpoint (loopback TCP, ipc, inproc)."""
    match = _ENDPOINT.match(endpoint)
    return match is None or match.group(2) is None or match.group(2) in _LOOPBACK_HOSTS

"""A server's role in disaggregated serving (docs/disaggregation.md): what a
request carrying sglang-router's bootstrap fields becomes on a prefill worker
and on a decode worker, who may send them, and the start-up check of the
prefill workers a decode worker names (--kv-peers).

prefill  the prompt runs with max_tokens 1 and its KV blocks are parked under
         the room for the decode worker; the request is admitted (a key the
         decode worker would refuse is refused here too) and charges nothing
decode   the prompt's blocks are pulled from the prefill worker the fields name
         before the rest is computed here; charged as any request
both     the fields are ignored: every request is served whole, as before
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping, Sequence

from fastapi import Request

from stoker.config import EngineConfig
from stoker.control.keys import SCOPE_ROUTER
from stoker.engine.kv_transfer import PeerCheck, probe_peer
from stoker.engine.params import KVTransferParams
from stoker.errors import APIError
from stoker.server.config import parse_peers
from stoker.server.protocol import BootstrapFields, bad_request
from stoker.server.serving.job import Job

logger = logging.getLogger("stoker.server")

PEER_CHECK_TIMEOUT = 5.0
"""Seconds a decode worker waits for each peer's answer at start before it warns that the peer is unreachable."""


def split_request(request: Request, body: BootstrapFields, job: Job, engine: EngineConfig, kv_peers: list[str]) -> None:
    """Turn the job into its half of a split request when the body carries a room and this server
    has a role (engine.kv_role); APIError (400/403) for fields this caller may not send or a request
    that cannot be split. kv_peers: --kv-peers, the prefill workers a decode worker may pull from."""
    role = engine.kv_role
    if role == "both" or body.bootstrap_room is None:
        return
    _check_caller(request)
    if len(job.prompts) != 1:
        raise bad_request(
            f"bootstrap_room pairs one prompt between a prefill and a decode worker; this request holds "
            f"{len(job.prompts)}",
            param="bootstrap_room",
        )
    if role == "prefill":
        job.kv_transfer = KVTransferParams(room=body.bootstrap_room, send=True)
        # The decode worker samples every output token; here only the prompt's blocks matter.
        job.params = dataclasses.replace(job.params, max_tokens=1, min_tokens=min(job.params.min_tokens, 1))
        job.charged = False
        return
    if not body.bootstrap_host:
        raise bad_request("bootstrap_room needs bootstrap_host on a decode worker", param="bootstrap_host")
    peer = (body.bootstrap_host, body.bootstrap_port or engine.kv_transfer_port)
    peers = parse_peers(kv_peers)
    if peers and peer not in peers:
        raise APIError(
            403,
            f"bootstrap_host:bootstrap_port {peer[0]}:{peer[1]} is not one of this decode worker's --kv-peers",
            "permission_error",
            param="bootstrap_host",
            code="kv_peer_not_allowed",
        )
    job.kv_transfer = KVTransferParams(room=body.bootstrap_room, send=False, peer_host=peer[0], peer_port=peer[1])


def _check_caller(request: Request) -> None:
    """Only a key with the router scope pairs workers: anyone else could make a decode worker
    connect where they like, or get prompts computed free on a prefill worker. Open mode has no
    keys to ask for (--kv-peers then bounds where a decode worker connects)."""
    plane = getattr(request.app.state, "control", None)
    if plane is None or not plane.auth_enabled():
        return
    key = getattr(request.state, "api_key", None)
    if key is None or not key.has_scope(SCOPE_ROUTER):
        raise APIError(
            403,
            "bootstrap_host, bootstrap_port and bootstrap_room pair a request between a prefill and a decode "
            f"worker: only a key with the '{SCOPE_ROUTER}' scope (the PD router's) may send them",
            "permission_error",
            param="bootstrap_room",
            code="insufficient_permissions",
        )


async def check_peers(
    peers: list[tuple[str, int]], layouts: Sequence[Mapping[str, str | int]], timeout: float = PEER_CHECK_TIMEOUT
) -> None:
    """At a decode worker's start: ValueError (one line) for the first peer whose KV layout matches
    none of this server's models (the line names what differs from the first); a warning for one
    that does not accept a connection (it may start later)."""
    if not layouts:
        raise ValueError("--kv-peers: this server reports no KV layout to compare (is it --role decode?)")
    checked = await asyncio.gather(
        *(asyncio.to_thread(_check_one, host, port, layouts, timeout) for host, port in peers)
    )
    for (host, port), check in zip(peers, checked):
        if check.problem is None:
            logger.info("KV peer %s:%d: same KV layout", host, port)
        elif not check.reachable:
            logger.warning("%s; the prompts it prefills are computed here until it answers", check.problem)
        else:
            raise ValueError(check.problem)


def _check_one(host: str, port: int, layouts: Sequence[Mapping[str, str | int]], timeout: float) -> PeerCheck:
    """The peer against each of this server's layouts: the first that matches, else the first's answer."""
    checks = [probe_peer(host, port, layout, timeout) for layout in layouts]
    return next((check for check in checks if check.problem is None), checks[0])

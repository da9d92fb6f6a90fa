"""FastAPI dependencies for authentication: `Authorization: Bearer <key>`.

    @router.post("/v1/chat/completions")
    async def chat(..., key: ApiKey | None = Depends(require_key)): ...

They find the ControlPlane at request.app.state.control. Every failure is an
APIError in OpenAI's error shape (rendered by the server's handlers,
stoker.server.app.install_error_handlers): 401 for a missing, malformed, unknown,
wrong, revoked or expired key; 403 for a key without the needed scope (and,
at admission, for a model the key may not use). In open mode (no key has
ever existed in the database) inference routes pass with key None, and so do
the read-only router, metrics and docs endpoints; every operator action (the
admin API, model loading, /flush_cache) stays shut, 403 naming how to create
the first admin key: otherwise anyone who reaches the port could mint keys,
load any file as a model or flush the cache.

Scopes (stoker.control.keys.SCOPES): inference (the /v1 API and the tokenizer
routes), router (/get_load, /server_info, /model_info, /flush_cache), metrics
(/metrics), admin (everything). Any valid key may read /docs, /openapi.json
and the detailed /ready.
"""

from __future__ import annotations

import time

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from stoker.control.keys import (
    SCOPE_ADMIN,
    SCOPE_INFERENCE,
    SCOPE_METRICS,
    ApiKey,
    AuthOutcome,
    check_secret,
    parse_key_id,
)
from stoker.control.plane import CREATE_FIRST_KEY, ControlPlane
from stoker.errors import APIError
from stoker.observe.logs import request_id_of

_MESSAGES = {
    AuthOutcome.MALFORMED: ("Incorrect API key provided.", "invalid_api_key"),
    AuthOutcome.UNKNOWN: ("Incorrect API key provided.", "invalid_api_key"),
    AuthOutcome.WRONG_SECRET: ("Incorrect API key provided.", "invalid_api_key"),
    AuthOutcome.REVOKED: ("This API key has been revoked.", "api_key_revoked"),
    AuthOutcome.EXPIRED: ("This API key has expired.", "api_key_expired"),
}


def get_plane(request: Request) -> ControlPlane:
    plane: ControlPlane | None = getattr(request.app.state, "control", None)
    if plane is None:
        raise RuntimeError("app.state.control is not set: create a ControlPlane in the app's lifespan")
    return plane


def _fail(
    request: Request,
    plane: ControlPlane,
    status: int,
    message: str,
    code: str,
    reason: str,
    type: str = "invalid_request_error",
    key: ApiKey | None = None,
) -> APIError:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    exc = APIError(status, message, type, code=code, headers=headers, reason=reason)
    plane.metrics.auth_failures.labels(reason).inc()
    plane.metrics.observe_error(status)
    request.state.logged = True  # the refusal's log line is written here
    plane.gate.refused(
        exc,
        request_id=request_id_of(request),
        key=key,
        method=request.method,
        path=request.url.path,
        headers=dict(request.headers),
    )
    return exc


async def authenticate(request: Request, scope: str | None = SCOPE_INFERENCE) -> ApiKey | None:
    """The caller's key, None in open mode, or raise APIError (401/403).
    scope None: any valid key will do."""
    plane = get_plane(request)
    if not plane.auth_enabled():
        request.state.api_key = None
        return None
    header = request.headers.get("authorization", "")
    if not header and request.headers.get("x-api-key"):
        # Anthropic's clients send the key bare in x-api-key (/v1/messages).
        header = "Bearer " + request.headers["x-api-key"]
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if not header:
        raise _fail(
            request,
            plane,
            401,
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
            "missing_api_key",
            "missing",
        )
    if scheme.lower() != "bearer" or not token:
        raise _fail(
            request,
            plane,
            401,
            "Malformed Authorization header; expected 'Bearer <key>'.",
            "invalid_api_key",
            "malformed",
        )
    key_id = parse_key_id(token)
    if key_id is None:
        outcome, key = AuthOutcome.MALFORMED, None
    else:
        hit, cached = plane.keys.cached(key_id, time.monotonic())
        # A cache miss queries the database: do it off the event loop.
        found = cached if hit else await run_in_threadpool(plane.keys.lookup, key_id)
        outcome, key = check_secret(found, token)
    if outcome is not AuthOutcome.OK:
        message, code = _MESSAGES[outcome]
        raise _fail(request, plane, 401, message, code, outcome.value)
    assert key is not None
    if scope is not None and not key.has_scope(scope):
        raise _fail(
            request,
            plane,
            403,
            f"This API key lacks the '{scope}' permission.",
            "insufficient_permissions",
            "scope",
            type="permission_error",
            key=key,
        )
    request.state.api_key = key
    return key


async def require_key(request: Request) -> ApiKey | None:
    """Dependency for inference routes."""
    return await authenticate(request, SCOPE_INFERENCE)


def _open_mode_refusal(request: Request, plane: ControlPlane, what: str, scope: str = SCOPE_ADMIN) -> APIError:
    needs = "an admin key" if scope == SCOPE_ADMIN else f"a key with the '{scope}' scope (or an admin key)"
    return _fail(
        request,
        plane,
        403,
        f"{what} needs {needs}, and this server runs open (no API key has ever been created in its "
        f"database). Create the first admin key with {CREATE_FIRST_KEY}; authentication then switches on "
        "by itself, for good.",
        "insufficient_permissions",
        "open_mode",
        type="permission_error",
    )


async def require_admin(request: Request) -> ApiKey:
    """Dependency for /admin routes: an admin key, even in open mode."""
    plane = get_plane(request)
    if not plane.auth_enabled():
        raise _open_mode_refusal(request, plane, "The admin API")
    key = await authenticate(request, SCOPE_ADMIN)
    assert key is not None
    return key


async def require_operator(request: Request, scope: str = SCOPE_ADMIN) -> ApiKey:
    """Operator actions that change the server for every client (/admin/models,
    POST /flush_cache): a key with `scope` (an admin key has every scope), and
    shut in open mode, where there is no key to give."""
    plane = get_plane(request)
    if not plane.auth_enabled():
        raise _open_mode_refusal(request, plane, f"{request.method} {request.url.path}", scope)
    key = await authenticate(request, scope)
    assert key is not None
    return key


async def require_scope(request: Request, scope: str | None) -> ApiKey | None:
    """Read-only endpoints beside inference (router polls, docs): open in open mode,
    else a key with `scope` (None: any valid key)."""
    return await authenticate(request, scope)


async def optional_key(request: Request) -> tuple[bool, ApiKey | None]:
    """(whether the caller may see the details, its key) for endpoints that answer
    probes without a key but tell more to a key holder (/ready): open mode, or any
    valid key, sees them; no credentials at all get the short answer; credentials
    that are wrong get 401, as anywhere else."""
    plane = get_plane(request)
    if not plane.auth_enabled():
        request.state.api_key = None
        return True, None
    if not request.headers.get("authorization") and not request.headers.get("x-api-key"):
        request.state.api_key = None
        return False, None
    return True, await authenticate(request, None)


async def require_metrics_access(request: Request) -> ApiKey | None:
    """Dependency for GET /metrics: with keys, one with the metrics scope; in open mode
    nothing, or (metrics_require_auth) refused until a key exists."""
    plane = get_plane(request)
    if not plane.auth_enabled():
        if plane.settings.metrics_require_auth:
            raise _open_mode_refusal(request, plane, "GET /metrics (--metrics-require-auth)", SCOPE_METRICS)
        return None
    return await authenticate(request, SCOPE_METRICS)

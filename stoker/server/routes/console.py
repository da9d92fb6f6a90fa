"""The web console's page and static assets (stoker/server/console/), at / and /ui/.

Audience: open. The files hold no data; every figure the page shows comes from
the API it calls with the user's key (the playground from /v1, the operator
pages from /admin and /console, admin scope), so serving them to anyone tells
nothing. `--no-ui` leaves these routes out (404).

Model output is shown by this page, so the page's own protection matters: a
Content-Security-Policy that allows scripts from this origin only (no inline
script, no eval), connections to this origin only, no framing; the files are
served with their real types and nosniff, so nothing else runs as script.
"""

from __future__ import annotations

from importlib import resources
from pathlib import PurePosixPath

from fastapi import APIRouter
from fastapi.responses import RedirectResponse, Response

from stoker.errors import APIError

router = APIRouter(include_in_schema=False)

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "connect-src 'self'",
        "img-src 'self' data:",
        "font-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
}
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
ASSETS = resources.files("stoker.server") / "console"


def _asset(name: str) -> Response:
    """One file of the console by its bare name; anything else (folders, dot-dot, other types) is a 404."""
    path = PurePosixPath(name)
    if len(path.parts) != 1 or path.suffix not in MEDIA_TYPES or name.startswith("."):
        raise APIError(404, f"No console file '{name}'.", code="not_found")
    file = ASSETS / name
    if not file.is_file():
        raise APIError(404, f"No console file '{name}'.", code="not_found")
    # no-cache: the browser revalidates each load, so an upgraded server never runs stale modules.
    headers = {**SECURITY_HEADERS, "Cache-Control": "no-cache"}
    return Response(file.read_bytes(), media_type=MEDIA_TYPES[path.suffix], headers=headers)


@router.get("/")
async def root() -> Response:
    return _asset("index.html")


@router.get("/ui")
async def ui_bare() -> RedirectResponse:
    return RedirectResponse("/ui/", status_code=308)


@router.get("/ui/")
async def ui_index() -> Response:
    return _asset("index.html")


@router.get("/ui/{name}")
async def ui_asset(name: str) -> Response:
    return _asset(name)

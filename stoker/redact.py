"""Secrets out of what stoker prints: one redaction for every URL that can carry a
password (--db, --redis-url, --otlp-endpoint) before it reaches a message or a log.

A URL holds a password in two places: its userinfo (`redis://:pw@host`,
`postgresql://user:pw@host/db`) and its query, where redis-py and libpq both read
one (`redis://host?password=pw`, `postgresql://host/db?password=pw&sslpassword=...`).
Both are replaced by `***`; the rest stays, so an operator can still tell which
server is meant.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit

MASK = "***"
# Query parameters that carry a secret in the URL schemes stoker accepts (redis-py,
# libpq / SQLAlchemy drivers, OTLP collectors behind basic auth).
SECRET_PARAMS = frozenset({"password", "pass", "pwd", "passwd", "sslpassword", "secret", "token", "api_key"})


def redact_url(url: str) -> str:
    """url with every password it carries replaced by ***; a string that is not a
    URL (a SQLite file path) comes back unchanged."""
    try:
        parts = urlsplit(url)
    except ValueError:
        # Not parseable as a URL (e.g. an unbalanced "[" in a host): show nothing after a "@".
        return f"{MASK}@{url.rsplit('@', 1)[1]}" if "@" in url else url
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user, has_password, _ = userinfo.partition(":")
        if has_password:
            netloc = f"{user}:{MASK}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(name.lower() in SECRET_PARAMS for name, _ in pairs):
            query = urlencode(
                [(name, MASK if name.lower() in SECRET_PARAMS else value) for name, value in pairs], safe="*"
            )
    if netloc == parts.netloc and query == parts.query:
        return url
    # Rebuilt by hand: urlunsplit drops an empty authority ("sqlite:////x.db", "unix:///sock").
    head = f"{parts.scheme}:" if parts.scheme else ""
    authority = f"//{netloc}" if url[len(head) :].startswith("//") else netloc
    tail = f"?{query}" if query else ""
    fragment = f"#{parts.fragment}" if parts.fragment else ""
    return f"{head}{authority}{parts.path}{tail}{fragment}"

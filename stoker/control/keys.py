"""API keys: generated with `secrets`, stored hashed, looked up by a public id.

A secret looks like `sk-stoker-<id>-<random>`. The id (not secret) lets the
server fetch exactly one row without a secret-dependent database lookup; the
random part carries 256 bits from `secrets.token_urlsafe(32)`.

Hashing: plain SHA-256 of the secret. Slow password hashes (bcrypt, argon2)
exist to make guessing *low-entropy* human passwords expensive; a 256-bit
random secret cannot be guessed however fast the hash is, so a slow hash
would only add milliseconds to every request. A leaked database therefore
yields no usable keys. The stored and presented hashes are compared with
hmac.compare_digest so the comparison time says nothing about the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Literal, cast

from sqlalchemy import Connection, Engine, func, select
from sqlalchemy.exc import DBAPIError

from stoker.control.db import AUTH_LATCH, api_keys, flags
from stoker.errors import APIError

SECRET_PREFIX = "sk-stoker-"
ID_HEX_CHARS = 12

PriorityClass = Literal["interactive", "batch"]
BudgetPeriod = Literal["day", "month"]
PRIORITY_CLASSES: tuple[str, ...] = ("interactive", "batch")
BUDGET_PERIODS: tuple[str, ...] = ("day", "month")
SCOPE_INFERENCE = "inference"
SCOPE_ADMIN = "admin"
# What a router in front of replicas calls besides inference: GET /get_load,
# /server_info, /model_info (and their /get_* aliases), POST /flush_cache.
SCOPE_ROUTER = "router"
# GET /metrics, for a Prometheus scrape.
SCOPE_METRICS = "metrics"
# Everything a key may be given; an admin key holds them all.
SCOPES: tuple[str, ...] = (SCOPE_INFERENCE, SCOPE_ROUTER, SCOPE_METRICS, SCOPE_ADMIN)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def parse_key_id(secret: str) -> str | None:
    """The public id inside a well-formed secret, or None."""
    if not secret.startswith(SECRET_PREFIX):
        return None
    rest = secret[len(SECRET_PREFIX) :]
    key_id, sep, random_part = rest[:ID_HEX_CHARS], rest[ID_HEX_CHARS : ID_HEX_CHARS + 1], rest[ID_HEX_CHARS + 1 :]
    if sep != "-" or len(random_part) < 16 or any(c not in "0123456789abcdef" for c in key_id):
        return None
    return key_id


@dataclass(frozen=True)
class ApiKey:
    """One key's settings; never holds the secret, only its hash."""

    id: str
    name: str
    prefix: str
    scopes: tuple[str, ...] = (SCOPE_INFERENCE,)
    models: tuple[str, ...] | None = None
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    budget_tokens: int | None = None
    budget_period: BudgetPeriod = "month"
    priority: PriorityClass = "interactive"
    created_at: float = 0.0
    expires_at: float | None = None
    revoked_at: float | None = None
    secret_hash: str = field(default="", repr=False)

    @property
    def is_admin(self) -> bool:
        return SCOPE_ADMIN in self.scopes

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    def expired(self, now: float | None = None) -> bool:
        return self.expires_at is not None and (now if now is not None else time.time()) >= self.expires_at

    def allows_model(self, model: str) -> bool:
        return self.models is None or model in self.models

    def has_scope(self, scope: str) -> bool:
        # An admin key may do everything any other key may.
        return scope in self.scopes or self.is_admin

    def public(self) -> dict[str, Any]:
        """What listings and the admin API show: everything but the hash."""
        out = asdict(self)
        out.pop("secret_hash")
        out["scopes"] = list(self.scopes)
        out["models"] = list(self.models) if self.models is not None else None
        out["status"] = "revoked" if self.revoked else "expired" if self.expired() else "active"
        return out


class AuthOutcome(str, Enum):
    OK = "ok"
    MALFORMED = "malformed"
    UNKNOWN = "unknown"
    WRONG_SECRET = "wrong_secret"
    REVOKED = "revoked"
    EXPIRED = "expired"


def _row_to_key(row: Any) -> ApiKey:
    m = row._mapping
    return ApiKey(
        id=m["id"],
        name=m["name"],
        prefix=m["prefix"],
        scopes=tuple(json.loads(m["scopes"])),
        models=tuple(json.loads(m["models"])) if m["models"] is not None else None,
        rpm=m["rpm"],
        tpm=m["tpm"],
        max_concurrent=m["max_concurrent"],
        budget_tokens=m["budget_tokens"],
        budget_period=m["budget_period"],
        priority=m["priority"],
        created_at=m["created_at"],
        expires_at=m["expires_at"],
        revoked_at=m["revoked_at"],
        secret_hash=m["secret_hash"],
    )


def normalize_scopes(scopes: list[str] | tuple[str, ...] | None, admin: bool = False) -> tuple[str, ...]:
    """The scopes a new key gets, in SCOPES order: inference unless others are named;
    ValueError naming an unknown one."""
    wanted = set(scopes) if scopes else {SCOPE_INFERENCE}
    unknown = sorted(wanted - set(SCOPES))
    if unknown:
        raise ValueError(f"unknown scope(s) {', '.join(map(repr, unknown))}; scopes are {', '.join(SCOPES)}")
    if admin:
        wanted |= {SCOPE_INFERENCE, SCOPE_ADMIN}
    return tuple(s for s in SCOPES if s in wanted)


def _set_latch(conn: Connection, value: str) -> None:
    """Insert the auth latch unless it is there (two creators at once: the first wins, neither fails)."""
    values = {"name": AUTH_LATCH, "value": value, "set_at": time.time()}
    dialect = conn.dialect.name
    if dialect in ("sqlite", "postgresql"):
        if dialect == "sqlite":
            from sqlalchemy.dialects.sqlite import insert
        else:
            from sqlalchemy.dialects.postgresql import insert  # type: ignore[assignment]
        conn.execute(insert(flags).values(**values).on_conflict_do_nothing(index_elements=["name"]))
        return
    if conn.execute(select(flags.c.name).where(flags.c.name == AUTH_LATCH)).first() is None:
        conn.execute(flags.insert().values(**values))


def _positive(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


class KeyStore:
    """Keys in the database, with a short-lived in-process cache so that
    authenticating a request rarely touches the database. Changes made by this
    process are visible at once; changes from elsewhere (the `stoker keys` CLI)
    within cache_ttl seconds."""

    def __init__(
        self,
        engine: Engine,
        cache_ttl: float = 5.0,
        negative_cache_size: int = 10_000,
        count_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.engine = engine
        self.count_failure = count_failure
        """Called with "key_lookup" when a lookup on the request path cannot reach the database."""
        self.cache_ttl = cache_ttl
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, ApiKey]] = {}
        # Unknown ids are cached too (bounded), so a flood of made-up keys
        # cannot turn into a flood of database queries.
        self._unknown: OrderedDict[str, float] = OrderedDict()
        self._unknown_max = negative_cache_size

    # -- management -------------------------------------------------------

    def create(
        self,
        name: str,
        *,
        rpm: int | None = None,
        tpm: int | None = None,
        max_concurrent: int | None = None,
        budget_tokens: int | None = None,
        budget_period: str = "month",
        priority: str = "interactive",
        models: list[str] | tuple[str, ...] | None = None,
        expires_at: float | None = None,
        admin: bool = False,
        scopes: list[str] | tuple[str, ...] | None = None,
    ) -> tuple[ApiKey, str]:
        """Create a key; returns it and its secret, which is never stored or shown again.
        scopes: what it may call (SCOPES; default inference only); admin=True adds "admin".
        The first key ever created latches the database into authenticated mode."""
        if not name or len(name) > 200:
            raise ValueError("name must be 1-200 characters")
        for label, value in (
            ("rpm", rpm),
            ("tpm", tpm),
            ("max_concurrent", max_concurrent),
            ("budget_tokens", budget_tokens),
        ):
            _positive(label, value)
        if budget_period not in BUDGET_PERIODS:
            raise ValueError(f"budget_period must be one of {BUDGET_PERIODS}, got {budget_period!r}")
        if priority not in PRIORITY_CLASSES:
            raise ValueError(f"priority must be one of {PRIORITY_CLASSES}, got {priority!r}")
        if models is not None:
            models = tuple(m.strip() for m in models if m.strip())
            if not models:
                raise ValueError("models must name at least one model (omit it to allow all)")
        granted = normalize_scopes(scopes, admin)
        key_id = secrets.token_hex(ID_HEX_CHARS // 2)
        secret = f"{SECRET_PREFIX}{key_id}-{secrets.token_urlsafe(32)}"
        key = ApiKey(
            id=key_id,
            name=name,
            prefix=secret[: len(SECRET_PREFIX) + ID_HEX_CHARS],
            scopes=granted,
            models=models,
            rpm=rpm,
            tpm=tpm,
            max_concurrent=max_concurrent,
            budget_tokens=budget_tokens,
            budget_period=cast(BudgetPeriod, budget_period),
            priority=cast(PriorityClass, priority),
            created_at=time.time(),
            expires_at=expires_at,
            secret_hash=hash_secret(secret),
        )
        row = asdict(key)
        row["scopes"] = json.dumps(list(granted))
        row["models"] = json.dumps(list(models)) if models is not None else None
        with self.engine.begin() as conn:
            conn.execute(api_keys.insert().values(**row))
            # In the same transaction: no key can exist without the latch.
            _set_latch(conn, f"key {key_id} ({name})")
        with self._lock:
            self._unknown.pop(key_id, None)
        return key, secret

    def get(self, key_id: str) -> ApiKey | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(api_keys).where(api_keys.c.id == key_id)).first()
        return _row_to_key(row) if row else None

    def list_keys(self, include_revoked: bool = True) -> list[ApiKey]:
        query = select(api_keys).order_by(api_keys.c.created_at)
        if not include_revoked:
            query = query.where(api_keys.c.revoked_at.is_(None))
        with self.engine.connect() as conn:
            return [_row_to_key(r) for r in conn.execute(query)]

    EDITABLE = frozenset(
        {"name", "rpm", "tpm", "max_concurrent", "budget_tokens", "budget_period", "priority", "models", "expires_at"}
    )
    """What update() may change: limits, budget, allow-list, expiry, name; never scopes or the secret."""

    def update(self, key_id: str, changes: dict[str, Any]) -> ApiKey | None:
        """Change the fields in changes (EDITABLE; None removes a limit, a budget, the
        allow-list or the expiry) with create()'s checks; the key as it is now, or None
        if there is no such key. Effective at once in this process."""
        unknown = sorted(set(changes) - self.EDITABLE)
        if unknown:
            raise ValueError(f"cannot change {', '.join(unknown)}; editable: {', '.join(sorted(self.EDITABLE))}")
        values = dict(changes)
        if "name" in values and (not values["name"] or len(values["name"]) > 200):
            raise ValueError("name must be 1-200 characters")
        for label in ("rpm", "tpm", "max_concurrent", "budget_tokens"):
            if label in values:
                _positive(label, values[label])
        if values.get("budget_period", "day") not in BUDGET_PERIODS:
            raise ValueError(f"budget_period must be one of {BUDGET_PERIODS}, got {values['budget_period']!r}")
        if values.get("priority", "batch") not in PRIORITY_CLASSES:
            raise ValueError(f"priority must be one of {PRIORITY_CLASSES}, got {values['priority']!r}")
        if values.get("models") is not None:
            models = [m.strip() for m in values["models"] if m.strip()]
            if not models:
                raise ValueError("models must name at least one model (null allows all)")
            values["models"] = json.dumps(models)
        if values:
            with self.engine.begin() as conn:
                conn.execute(api_keys.update().where(api_keys.c.id == key_id).values(**values))
        self.invalidate(key_id)
        return self.get(key_id)

    def revoke(self, key_id: str) -> bool:
        """True if the key existed and was active; effective at once in this process."""
        with self.engine.begin() as conn:
            result = conn.execute(
                api_keys.update()
                .where(api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None))
                .values(revoked_at=time.time())
            )
        self.invalidate(key_id)
        return result.rowcount > 0

    def latch(self) -> str | None:
        """Why this database is authenticated for good ("key <id> (<name>)", set when
        its first key was created), or None while no key has ever existed in it."""
        with self.engine.connect() as conn:
            row = conn.execute(select(flags.c.value).where(flags.c.name == AUTH_LATCH)).first()
            if row is not None:
                return str(row[0])
            # A key row without the latch (inserted by hand, or by a stoker older than
            # the latch that shares this database): it latches all the same.
            key = conn.execute(select(api_keys.c.id).limit(1)).first()
        if key is None:
            return None
        with self.engine.begin() as conn:
            _set_latch(conn, f"key {key[0]}")
        return f"key {key[0]}"

    def count_active(self, now: float | None = None) -> int:
        now = now if now is not None else time.time()
        query = (
            select(func.count())
            .select_from(api_keys)
            .where(
                api_keys.c.revoked_at.is_(None),
                (api_keys.c.expires_at.is_(None)) | (api_keys.c.expires_at > now),
            )
        )
        with self.engine.connect() as conn:
            return int(conn.execute(query).scalar_one())

    def invalidate(self, key_id: str | None = None) -> None:
        with self._lock:
            if key_id is None:
                self._cache.clear()
                self._unknown.clear()
            else:
                self._cache.pop(key_id, None)
                self._unknown.pop(key_id, None)

    # -- request path ------------------------------------------------------

    def cached(self, key_id: str, now: float) -> tuple[bool, ApiKey | None]:
        """(hit, key) from the cache without touching the database."""
        with self._lock:
            entry = self._cache.get(key_id)
            if entry and now - entry[0] < self.cache_ttl:
                return True, entry[1]
            seen = self._unknown.get(key_id)
            if seen is not None and now - seen < self.cache_ttl:
                return True, None
        return False, None

    def lookup(self, key_id: str, now: float | None = None) -> ApiKey | None:
        now = now if now is not None else time.monotonic()
        hit, key = self.cached(key_id, now)
        if hit:
            return key
        try:
            key = self.get(key_id)
        except DBAPIError:
            if self.count_failure is not None:
                self.count_failure("key_lookup")
            with self._lock:
                stale = self._cache.get(key_id)
            if stale is not None:
                # Known a moment ago: keep serving it while the database is away
                # (a revocation made meanwhile takes effect when it answers again).
                return stale[1]
            raise APIError(
                503,
                "The key database is unreachable; please retry shortly.",
                "service_unavailable",
                code="store_unavailable",
                reason="store_unavailable",
                retry_after=2,
            ) from None
        with self._lock:
            if key is None:
                self._unknown[key_id] = now
                self._unknown.move_to_end(key_id)
                while len(self._unknown) > self._unknown_max:
                    self._unknown.popitem(last=False)
            else:
                self._cache[key_id] = (now, key)
        return key

    def authenticate(self, secret: str) -> tuple[AuthOutcome, ApiKey | None]:
        """Check a presented secret. May query the database on a cache miss."""
        key_id = parse_key_id(secret)
        if key_id is None:
            return AuthOutcome.MALFORMED, None
        key = self.lookup(key_id)
        return check_secret(key, secret)


def check_secret(key: ApiKey | None, secret: str, now: float | None = None) -> tuple[AuthOutcome, ApiKey | None]:
    if key is None:
        return AuthOutcome.UNKNOWN, None
    if not hmac.compare_digest(key.secret_hash, hash_secret(secret)):
        return AuthOutcome.WRONG_SECRET, None
    if key.revoked:
        return AuthOutcome.REVOKED, key
    if key.expired(now):
        return AuthOutcome.EXPIRED, key
    return AuthOutcome.OK, key

"""ControlSettings: the control plane's options, in a module of its own (pydantic
only) so `stoker serve --help` can list them without importing the database,
metrics and tracing stacks. stoker.server.config turns each field into a
`stoker serve` option, a YAML key and a STOKER_* variable."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ControlSettings(BaseModel):
    """API keys, quotas, admission and observability. Each field is a `stoker serve`
    option, a YAML key and a STOKER_* variable (see stoker.server.config)."""

    model_config = ConfigDict(extra="forbid")

    db: str | None = None
    """Key and usage database: SQLite file path or SQLAlchemy URL (postgresql://...); default ~/.stoker/stoker.db."""
    redis_url: str | None = None
    """Redis (redis://, rediss://, unix://) holding per-key rate limits and concurrency, shared by every replica using it; default: in this process."""
    on_store_failure: Literal["closed", "open"] = "closed"
    """When the Redis of --redis-url, or a shared --db (PostgreSQL) for budgets, is unreachable: closed refuses requests with 503 + Retry-After; open admits them without limits (logged)."""
    redis_lease_ttl: float = Field(30.0, ge=1)
    """Seconds a request's concurrency slot lives in Redis unless renewed (every third of it while the request runs): a dead replica's slots free themselves within it."""
    require_auth: bool = False
    """Refuse to start unless the database holds an active API key (otherwise the server runs open, inference only, while no key has ever existed)."""
    allow_open: bool = False
    """Serve open (no key ever created) on an address other than loopback; without it such a start is refused (exit 2). Open mode serves inference only."""
    metrics_require_auth: bool = False
    """In open mode, require a key for GET /metrics too (with keys it always takes a key with the metrics scope)."""
    max_queued_requests: int = Field(256, ge=1)
    """Admission bound on waiting requests (engine queue + admitted in transit); beyond it 503 overloaded."""
    max_queued_tokens: int = Field(65_536, ge=1)
    """Admission bound on waiting prompt tokens; beyond it 503 overloaded."""
    batch_queue_share: float = Field(0.8, gt=0, le=1)
    """Share of the queue bounds that batch-priority requests may fill (the rest is kept for interactive ones)."""
    max_queue_wait: float | None = Field(300.0, gt=0)
    """Cap in seconds on a request's deadline (x-stoker-deadline-ms header or `timeout` field)."""
    model_name: str = "model"
    """model_name label on vllm: metrics (the server sets the served model name)."""
    cost_per_hour: float | None = Field(None, ge=0)
    """Price of the machine in dollars per hour: exports stoker:cost_per_million_tokens per model (docs/operations.md). None: no cost metric."""
    metrics_per_key: bool = False
    """Export per-key metric series (budget remaining); off keeps cardinality bounded."""
    otlp_endpoint: str | None = None
    """OTLP/HTTP collector (e.g. http://127.0.0.1:4318) for request traces; tracing is off without it."""
    ledger_flush_interval: float = Field(1.0, gt=0)
    """Seconds between batched writes of usage rows."""
    key_cache_ttl: float = Field(5.0, ge=0)
    """Seconds a key lookup is cached; keys created or revoked elsewhere take effect within it."""

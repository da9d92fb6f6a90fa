"""Prometheus metrics. vLLM's names (with a `model_name` label) wherever the
meaning is the same, so existing vLLM dashboards and alerts work unchanged;
`stoker:` names for what vLLM does not have (admission, quotas, drain).

Everything lives in this object's own CollectorRegistry: no global state, so
tests and several apps in one process do not collide.

Counters the engine keeps cumulatively (tokens, preemptions, prefix cache)
are turned into increments here, so an engine restart (its counters start
again from zero) never makes a Prometheus counter go backwards.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from stoker.engine.params import EngineStats, RequestTimes

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
    640.0,
)
_ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
# The shared stores and the calls of each that can fail (the `operation` label):
# a fixed handful, so the series stay few whatever happens.
STORE_OPERATIONS: dict[str, tuple[str, ...]] = {
    # --redis-url: the admission check-and-take, the release after a response, lease renewal.
    "redis": ("acquire", "release", "renew"),
    # --db: a key looked up on a cache miss, shared budget reservations, usage rows.
    "db": ("key_lookup", "budget_reserve", "budget_release", "budget_renew", "ledger_write"),
}

_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

# EngineStats counter field -> attribute name of our Counter
_CUMULATIVE = (
    "num_preemptions",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "prompt_tokens",
    "generation_tokens",
    "steps",
    "constrained_requests",
    "grammar_mask_steps",
    "grammar_compiles",
    "spec_drafts",
    "spec_draft_tokens",
    "spec_accepted_tokens",
    "kv_events_published",
    "kv_events_dropped",
    "kv_disk_hits",
    "kv_disk_misses",
    "kv_disk_bytes_read",
    "kv_disk_bytes_written",
    "kv_disk_writes_dropped",
    "kv_disk_evictions",
    "kv_disk_corrupt_dropped",
    *(
        "kv_transfer_blocks_sent",
        "kv_transfer_bytes_sent",
        "kv_transfer_blocks_received",
        "kv_transfer_bytes_received",
        "kv_transfer_blocks_skipped",
        "kv_transfer_pulls",
        "kv_transfer_pull_seconds",
        "kv_transfer_pulls_failed",
        "kv_transfer_pulls_timed_out",
        "kv_transfer_rooms_expired",
    ),
    "lora_loads",
    "lora_load_failures",
    "lora_evictions",
)

_KV_DISK_COUNTERS = {
    "kv_disk_hits": ("stoker:kv_disk_hits", "KV blocks read from the disk tier (--kv-cache-disk) into RAM."),
    "kv_disk_misses": (
        "stoker:kv_disk_misses",
        "KV blocks looked for on the disk tier and not served (absent, or dropped as corrupt).",
    ),
    "kv_disk_bytes_read": ("stoker:kv_disk_read_bytes", "Bytes of block files read from the disk tier."),
    "kv_disk_bytes_written": ("stoker:kv_disk_written_bytes", "Bytes of block files written to the disk tier."),
    "kv_disk_writes_dropped": (
        "stoker:kv_disk_writes_dropped",
        "KV blocks not written to the disk tier: its queue was full or its writes were paused.",
    ),
    "kv_disk_evictions": ("stoker:kv_disk_evictions", "Block files removed to stay within --kv-cache-disk-size."),
    "kv_disk_corrupt_dropped": (
        "stoker:kv_disk_corrupt_dropped",
        "Block files removed as truncated, corrupt, or of another model or layout (never served).",
    ),
}
_KV_TRANSFER_COUNTERS = {
    "kv_transfer_blocks_sent": (
        "stoker:kv_transfer_blocks_sent",
        "KV blocks this prefill worker sent to decode workers.",
    ),
    "kv_transfer_bytes_sent": ("stoker:kv_transfer_sent_bytes", "Bytes of KV blocks sent to decode workers."),
    "kv_transfer_blocks_received": (
        "stoker:kv_transfer_blocks_received",
        "KV blocks this decode worker received from prefill workers, verified and indexed.",
    ),
    "kv_transfer_bytes_received": ("stoker:kv_transfer_received_bytes", "Bytes of KV blocks received."),
    "kv_transfer_blocks_skipped": (
        "stoker:kv_transfer_blocks_skipped",
        "Prompt blocks this decode worker held already in its prefix cache, so not pulled.",
    ),
    "kv_transfer_pulls": ("stoker:kv_transfer_pulls", "Pulls of a prompt's blocks this decode worker finished."),
    "kv_transfer_pull_seconds": (
        "stoker:kv_transfer_pull_seconds",
        "Seconds from a pull's start to its blocks indexed, summed (divide by stoker:kv_transfer_pulls).",
    ),
    "kv_transfer_pulls_failed": (
        "stoker:kv_transfer_pulls_failed",
        "Pulls that brought nothing usable (refused, unknown room, unreachable, a block failing its checks): computed here.",
    ),
    "kv_transfer_pulls_timed_out": (
        "stoker:kv_transfer_pulls_timed_out",
        "Pulls given up after --kv-transfer-timeout: the rest of the prompt was computed here.",
    ),
    "kv_transfer_rooms_expired": (
        "stoker:kv_transfer_rooms_expired",
        "Prompts whose parked blocks no decode worker pulled within --kv-transfer-timeout.",
    ),
}
"""Disaggregated serving's counters (docs/disaggregation.md): EngineStats field -> (metric, help)."""

"""The disk tier's counters: EngineStats field -> (metric, help). The RAM tier keeps vLLM's names
(vllm:prefix_cache_queries / _hits, which count blocks loaded from disk as hits too)."""


class Metrics:
    def __init__(self, model_name: str = "model", per_key_labels: bool = False) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.per_key_labels = per_key_labels
        r, m = self.registry, ["model_name"]

        # -- vLLM-compatible --------------------------------------------------
        self.running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", m, registry=r
        )
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", m, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", m, registry=r)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed (prefix-cache hits included).", m, registry=r
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", m, registry=r
        )
        self.request_success = Counter(
            "vllm:request_success", "Count of successfully processed requests.", m + ["finished_reason"], registry=r
        )
        self.preemptions = Counter(
            "vllm:num_preemptions", "Cumulative number of preemptions from the engine.", m, registry=r
        )
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", m, registry=r
        )
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", m, registry=r
        )
        self.spec_drafts = Counter(
            "vllm:spec_decode_num_drafts", "Number of spec decoding drafts (proposals verified).", m, registry=r
        )
        self.spec_draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens", "Number of draft tokens verified.", m, registry=r
        )
        self.spec_accepted_tokens = Counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted draft tokens.", m, registry=r
        )
        self.spec_accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by their position in the proposal.",
            m + ["position"],
            registry=r,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            m,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            m,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            m,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            m,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", m, buckets=_TOKEN_BUCKETS, registry=r
        )
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            m,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.iteration_tokens = Histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            m,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )

        # -- stoker ----------------------------------------------------------
        self.kv_disk_counters = {
            field: Counter(metric, text, m, registry=r) for field, (metric, text) in _KV_DISK_COUNTERS.items()
        }
        self.kv_transfer_counters = {
            field: Counter(metric, text, m, registry=r) for field, (metric, text) in _KV_TRANSFER_COUNTERS.items()
        }
        self.kv_transfer_rooms_parked = Gauge(
            "stoker:kv_transfer_rooms_parked",
            "Prompts whose KV blocks this prefill worker holds until a decode worker pulls them.",
            m,
            registry=r,
        )
        self.kv_disk_pending_writes = Gauge(
            "stoker:kv_disk_pending_writes", "KV blocks queued for the disk tier's writer.", m, registry=r
        )
        self.kv_disk_used_bytes = Gauge(
            "stoker:kv_disk_used_bytes", "Bytes of block files on the disk tier.", m, registry=r
        )
        self.kv_disk_degraded = Gauge(
            "stoker:kv_disk_degraded",
            "1 while the disk tier's writes are paused (disk full, read-only, gone) and blocks are served from RAM only.",
            m,
            registry=r,
        )
        self.kv_events_published = Counter(
            "stoker:kv_events_published", "KV event batches published on --kv-events-endpoint.", m, registry=r
        )
        self.kv_events_dropped = Counter(
            "stoker:kv_events_dropped",
            "KV event batches dropped because a subscriber fell behind (the socket's queue was full).",
            m,
            registry=r,
        )
        self.constrained_requests = Counter(
            "stoker:structured_requests",
            "Requests whose output is constrained (JSON schema, regex, choice, grammar, tool call).",
            m,
            registry=r,
        )
        self.grammar_mask_time = Histogram(
            "stoker:grammar_mask_seconds",
            "Per engine step with constrained sequences: seconds spent computing their token bitmasks.",
            m,
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
            registry=r,
        )
        self.grammar_compile_time = Histogram(
            "stoker:grammar_compile_seconds",
            "Seconds to compile an output grammar in the engine (cache misses).",
            m,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )

        # -- LoRA adapters (docs/lora.md) ------------------------------------------
        self.lora_info = Gauge(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests: the adapters of running and waiting requests, comma-separated; "
            "the value is when it was last seen (set_to_current_time), one series per model.",
            ["model_name", "max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=r,
        )
        self._lora_info_labels: dict[str, tuple[str, str, str, str]] = {}
        self.lora_counters = {
            "lora_loads": Counter(
                "stoker:lora_loads",
                "LoRA adapter loads from their files: registrations, and reloads after an eviction.",
                m,
                registry=r,
            ),
            "lora_load_failures": Counter(
                "stoker:lora_load_failures",
                "LoRA adapter loads that failed: refused registrations, reloads of a file since changed or removed.",
                m,
                registry=r,
            ),
            "lora_evictions": Counter(
                "stoker:lora_evictions",
                "LoRA adapters dropped from memory to stay within --max-loaded-loras (loaded again when named).",
                m,
                registry=r,
            ),
        }
        self.lora_registered = Gauge("stoker:lora_adapters_registered", "LoRA adapters registered.", m, registry=r)
        self.lora_resident = Gauge(
            "stoker:lora_adapters_resident", "LoRA adapters in memory (at most --max-loaded-loras).", m, registry=r
        )
        self.lora_resident_bytes = Gauge(
            "stoker:lora_resident_bytes", "Bytes the resident LoRA adapters' tensors take.", m, registry=r
        )
        self.lora_load_time = Histogram(
            "stoker:lora_load_seconds",
            "Seconds to load a LoRA adapter from its file (registration or reload after eviction).",
            m,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

        # -- models (several per server, versions, fallback, cost) --------------
        self.model_version_info = Gauge(
            "stoker:model_version_info",
            "1 per model version loaded: which file (digest) answers under a model name, its state, and the "
            "ISA path of its int8 kernels (none: weights dequantized; empty while it loads).",
            ["model_name", "version", "digest", "path", "status", "quantized_matmul"],
            registry=r,
        )
        self.version_requests = Counter(
            "stoker:model_version_requests",
            "Requests finished per model version, by outcome (ok or error): compare a canary with its stable version.",
            ["model_name", "version", "outcome"],
            registry=r,
        )
        self.version_ttft = Histogram(
            "stoker:model_version_time_to_first_token_seconds",
            "Time to first token per model version.",
            ["model_name", "version"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.version_e2e = Histogram(
            "stoker:model_version_e2e_request_latency_seconds",
            "End-to-end request latency per model version.",
            ["model_name", "version"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.fallbacks = Counter(
            "stoker:fallbacks",
            "Requests served by a fallback model: from the model asked for, to the one that answered, and why.",
            ["from", "to", "reason"],
            registry=r,
        )
        self.cost_per_million = Gauge(
            "stoker:cost_per_million_tokens",
            "Dollars per 1M tokens of a kind, from --cost-per-hour and the tokens of the last minute (docs/operations.md).",
            ["model_name", "kind"],
            registry=r,
        )

        self.kv_capacity = Gauge(
            "stoker:kv_cache_capacity_tokens",
            "Tokens the KV cache holds over all running requests (its blocks x block size).",
            m,
            registry=r,
        )
        self.prompt_tokens_computed = Counter(
            "stoker:prompt_tokens_computed",
            "Prompt tokens computed by the model (prefix-cache hits excluded).",
            m,
            registry=r,
        )
        self.admission_rejections = Counter(
            "stoker:admission_rejections",
            "Requests refused with 503 for lack of capacity, by reason.",
            ["reason"],
            registry=r,
        )
        self.store_failures = Counter(
            "stoker:store_failures",
            "Calls to Redis (--redis-url) or the database (--db) that failed, by store and operation; "
            "counted whatever the failure led to (503, admission without limits, rows kept for later).",
            ["store", "operation"],
            registry=r,
        )
        self.rate_limit_rejections = Counter(
            "stoker:rate_limit_rejections",
            "Requests refused with 429 for a key's quota, by limit.",
            ["limit"],
            registry=r,
        )
        self.auth_failures = Counter(
            "stoker:auth_failures", "Requests refused with 401/403, by reason.", ["reason"], registry=r
        )
        self.deadline_drops = Counter(
            "stoker:deadline_exceeded", "Requests whose deadline passed, by phase.", ["phase"], registry=r
        )
        self.engine_restarts = Counter("stoker:engine_restarts", "Times the engine process was restarted.", registry=r)
        self.model_sleeping = Gauge(
            "stoker:model_sleeping",
            "1 while a model sleeps (its engine process ended, idle; the next request wakes it), else 0.",
            m,
            registry=r,
        )
        self.model_wake_seconds = Histogram(
            "stoker:model_wake_seconds",
            "Time a sleeping model's engine took to start again (its next request waited this long more).",
            m,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.draining = Gauge(
            "stoker:draining", "1 while the server drains (refuses new requests) before shutdown.", registry=r
        )
        self.in_flight = Gauge("stoker:requests_in_flight", "Requests admitted and not yet finished.", registry=r)
        self.queued_requests = Gauge(
            "stoker:admission_queue_requests",
            "Waiting requests as admission sees them (engine + in transit).",
            registry=r,
        )
        self.queued_tokens = Gauge(
            "stoker:admission_queue_tokens",
            "Waiting prompt tokens as admission sees them (engine + in transit).",
            registry=r,
        )
        self.drain_rate = Gauge(
            "stoker:drain_rate_tokens_per_second",
            "Prompt tokens finished per second recently (drives Retry-After).",
            registry=r,
        )
        self.request_errors = Counter(
            "stoker:request_errors", "Requests that ended with an error status, by HTTP status.", ["status"], registry=r
        )
        self.ledger_pending = Gauge(
            "stoker:ledger_pending_records", "Usage records not yet written to the database.", registry=r
        )
        self.budget_exhausted_keys = Gauge(
            "stoker:budget_exhausted_keys", "Keys refused for budget in the current period.", registry=r
        )
        self.budget_remaining = (
            Gauge(
                "stoker:budget_remaining_tokens",
                "Tokens left in a key's budget for the period.",
                ["key_id", "key_name"],
                registry=r,
            )
            if per_key_labels
            else None
        )

        self._last: dict[str | None, EngineStats] = {}
        """Each engine's previous snapshot (by source), whose counters the next one's grow from."""

    # -- engine ------------------------------------------------------------------

    def engine_restarted(self, source: str | None = None) -> None:
        self.engine_restarts.inc()
        self._last[source] = EngineStats()  # the new engine counts from zero

    def update_from_engine_stats(
        self, stats: EngineStats, model_name: str | None = None, source: str | None = None, gauges: bool = True
    ) -> None:
        """Set the gauges (unless gauges=False: a second engine of the model,
        during a swap or canary) and add the growth of the cumulative counters
        of engine `source` (default: the model's only one)."""
        name = model_name or self.model_name
        source = source or model_name
        if gauges:
            self.running.labels(name).set(stats.num_running)
            self.waiting.labels(name).set(stats.num_waiting)
            self.kv_usage.labels(name).set(stats.kv_usage)
            self.kv_capacity.labels(name).set(stats.kv_blocks_total * stats.block_size)
        last = self._last.get(source, EngineStats())
        if any(getattr(stats, f) < getattr(last, f) for f in _CUMULATIVE):
            last = EngineStats()  # counters went back: the engine restarted without telling us
        delta = {f: getattr(stats, f) - getattr(last, f) for f in _CUMULATIVE}
        self.prompt_tokens.labels(name).inc(delta["prompt_tokens"] + delta["prefix_cache_hits"])
        self.prompt_tokens_computed.labels(name).inc(delta["prompt_tokens"])
        self.generation_tokens.labels(name).inc(delta["generation_tokens"])
        self.preemptions.labels(name).inc(delta["num_preemptions"])
        self.prefix_queries.labels(name).inc(delta["prefix_cache_queries"])
        self.prefix_hits.labels(name).inc(delta["prefix_cache_hits"])
        steps = delta["steps"]
        if steps >= 1:
            # Exact when we see every step; when snapshots skip steps, the
            # skipped ones get the mean of the tokens processed in between, so
            # the histogram's count and sum stay right.
            self.iteration_tokens.labels(name).observe(stats.last_step_tokens)
            rest = delta["prompt_tokens"] + delta["generation_tokens"] - stats.last_step_tokens
            if steps > 1 and rest > 0:
                mean = rest / (steps - 1)
                for _ in range(min(steps - 1, 1000)):
                    self.iteration_tokens.labels(name).observe(mean)
        self.spec_drafts.labels(name).inc(delta["spec_drafts"])
        self.spec_draft_tokens.labels(name).inc(delta["spec_draft_tokens"])
        self.spec_accepted_tokens.labels(name).inc(delta["spec_accepted_tokens"])
        before = last.spec_accepted_per_position
        for position, count in enumerate(stats.spec_accepted_per_position):
            grown = count - (before[position] if position < len(before) else 0)
            if grown > 0:
                self.spec_accepted_per_pos.labels(name, str(position)).inc(grown)
        self.constrained_requests.labels(name).inc(delta["constrained_requests"])
        self.kv_events_published.labels(name).inc(delta["kv_events_published"])
        self.kv_events_dropped.labels(name).inc(delta["kv_events_dropped"])
        for field, counter in self.kv_disk_counters.items():
            counter.labels(name).inc(delta[field])
        for field, counter in self.kv_transfer_counters.items():
            counter.labels(name).inc(delta[field])
        if gauges:
            self.kv_disk_pending_writes.labels(name).set(stats.kv_disk_pending_writes)
            self.kv_disk_used_bytes.labels(name).set(stats.kv_disk_bytes_used)
            self.kv_disk_degraded.labels(name).set(1 if stats.kv_disk_degraded else 0)
            self.kv_transfer_rooms_parked.labels(name).set(stats.kv_transfer_rooms_parked)
        for field, counter in self.lora_counters.items():
            counter.labels(name).inc(delta[field])
        _observe_latest(self.lora_load_time.labels(name), stats.lora_load_seconds, delta["lora_loads"])
        if gauges and (stats.lora_registered or name in self._lora_info_labels):
            self._set_lora_gauges(name, stats)
        _observe_latest(self.grammar_mask_time.labels(name), stats.grammar_mask_seconds, delta["grammar_mask_steps"])
        _observe_latest(
            self.grammar_compile_time.labels(name), stats.grammar_compile_seconds, delta["grammar_compiles"]
        )
        self._last[source] = stats

    def _set_lora_gauges(self, name: str, stats: EngineStats) -> None:
        """The resident set, and vllm:lora_requests_info as vLLM sets it: one series
        for the adapters running and waiting now, its value the time; the model's
        previous series goes, so adapter combinations never pile up."""
        self.lora_registered.labels(name).set(stats.lora_registered)
        self.lora_resident.labels(name).set(stats.lora_resident)
        self.lora_resident_bytes.labels(name).set(stats.lora_resident_bytes)
        labels = (
            name,
            str(stats.max_loras),
            ",".join(sorted(stats.lora_waiting)),
            ",".join(sorted(stats.lora_running)),
        )
        previous = self._lora_info_labels.get(name)
        if previous is not None and previous != labels:
            self.lora_info.remove(*previous)
        self._lora_info_labels[name] = labels
        self.lora_info.labels(*labels).set_to_current_time()

    # -- requests -----------------------------------------------------------------

    def observe_finished(
        self,
        times: RequestTimes | None,
        prompt_tokens: int,
        generation_tokens: int,
        finish_reason: str | None,
        model_name: str | None = None,
    ) -> None:
        """Latency histograms from the engine's own timestamps, for one finished request."""
        name = model_name or self.model_name
        self.request_prompt_tokens.labels(name).observe(prompt_tokens)
        self.request_generation_tokens.labels(name).observe(generation_tokens)
        self.observe_sample(times, finish_reason, name)

    def observe_sample(
        self, times: RequestTimes | None, finish_reason: str | None, model_name: str | None = None
    ) -> None:
        """Outcome and latencies of one sample (n > 1 requests have several)."""
        name = model_name or self.model_name
        self.request_success.labels(name, finish_reason or "abort").inc()
        if times is None:
            return
        if times.scheduled is not None:
            self.queue_time.labels(name).observe(max(0.0, times.scheduled - times.arrival))
        if times.first_token is not None:
            self.ttft.labels(name).observe(max(0.0, times.first_token - times.arrival))
        stamps = times.token_times
        for earlier, later in pairwise(stamps):
            self.itl.labels(name).observe(max(0.0, later - earlier))
        if times.finished is not None:
            self.e2e.labels(name).observe(max(0.0, times.finished - times.arrival))

    def observe_version(self, model_name: str, version: str, ok: bool, ttft: float | None, e2e: float | None) -> None:
        """One finished request of a model version (per-version series for canaries)."""
        self.version_requests.labels(model_name, version, "ok" if ok else "error").inc()
        if ttft is not None:
            self.version_ttft.labels(model_name, version).observe(max(0.0, ttft))
        if e2e is not None:
            self.version_e2e.labels(model_name, version).observe(max(0.0, e2e))

    def set_model_versions(self, versions: list[tuple[str, str, str, str, str, str]]) -> None:
        """The versions loaded now: (model_name, version, digest, path, status, quantized_matmul) each."""
        self.model_version_info.clear()
        for labels in versions:
            self.model_version_info.labels(*labels).set(1)

    def set_sleeping(self, models: dict[str, bool]) -> None:
        """Whether each model loaded now sleeps (an unloaded one's series goes)."""
        self.model_sleeping.clear()
        for name, asleep in models.items():
            self.model_sleeping.labels(name).set(1 if asleep else 0)

    def set_costs(self, costs: dict[str, dict[str, float]]) -> None:
        self.cost_per_million.clear()
        for model, kinds in costs.items():
            for kind, dollars in kinds.items():
                self.cost_per_million.labels(model, kind).set(dollars)

    def observe_error(self, status: int) -> None:
        self.request_errors.labels(str(status)).inc()

    def store_failure_counter(self, store: str) -> Callable[[str], None]:
        """What a store calls with the operation that failed. Its series exist at 0
        from now on, so the first failure already shows in rate() and increase()."""
        operations = STORE_OPERATIONS[store]
        for operation in operations:
            self.store_failures.labels(store, operation)

        def failed(operation: str) -> None:
            # A new name would be a new series nobody alerts on: add it to STORE_OPERATIONS.
            assert operation in operations, f"unknown {store} operation {operation!r}"
            self.store_failures.labels(store, operation).inc()

        return failed

    def set_budget_remaining(self, key_id: str, key_name: str, remaining: int) -> None:
        if self.budget_remaining is not None:
            self.budget_remaining.labels(key_id, key_name).set(remaining)

    # -- exposition ---------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """(body, content type) for GET /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _observe_latest(histogram: Histogram, recent: list[float], new: int) -> None:
    """Observe the `new` latest values (the engine keeps a bounded window of them)."""
    for value in recent[len(recent) - min(new, len(recent)) :]:
        histogram.observe(value)

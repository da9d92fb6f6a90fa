"""Prometheus metrics: vLLM names and meanings, counters from cumulative engine stats, histograms from engine timestamps."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from stoker.engine.params import EngineStats, RequestTimes
from stoker.observe.metrics import Metrics

VLLM_NAMES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_bucket",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:iteration_tokens_total_bucket",
]


def samples(m: Metrics) -> dict[tuple[str, tuple], float]:
    body, ctype = m.render()
    assert ctype.startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: Metrics, name: str, **labels) -> float:
    labels = {"model_name": "smol", **labels} if name.startswith("vllm:") else labels
    return samples(m).get((name, tuple(sorted(labels.items()))), 0.0)


def test_every_vllm_name_is_exposed():
    m = Metrics("smol")
    m.update_from_engine_stats(EngineStats(num_running=1, steps=1, last_step_tokens=3, prompt_tokens=3))
    m.observe_finished(RequestTimes(1, 1.1, 1.2, 1.4, 1.5, [1.2, 1.3, 1.4]), 3, 3, "stop")
    names = {name for name, _ in samples(m)}
    missing = [n for n in VLLM_NAMES if n not in names]
    assert not missing, missing


def test_gauges_and_counter_increments_from_cumulative_stats():
    m = Metrics("smol")
    m.update_from_engine_stats(
        EngineStats(
            num_running=2,
            num_waiting=3,
            kv_blocks_total=100,
            kv_blocks_used=25,
            prompt_tokens=100,
            prefix_cache_hits=20,
            prefix_cache_queries=120,
            generation_tokens=10,
            num_preemptions=1,
            steps=5,
            last_step_tokens=12,
        )
    )
    m.update_from_engine_stats(
        EngineStats(
            num_running=1,
            prompt_tokens=150,
            prefix_cache_hits=20,
            prefix_cache_queries=170,
            generation_tokens=30,
            num_preemptions=1,
            steps=6,
            last_step_tokens=70,
        )
    )
    assert value(m, "vllm:num_requests_running") == 1
    assert value(m, "vllm:num_requests_waiting") == 0
    assert value(m, "vllm:prompt_tokens_total") == 170  # 150 computed + 20 from the prefix cache
    assert value(m, "stoker:prompt_tokens_computed_total", model_name="smol") == 150
    assert value(m, "vllm:generation_tokens_total") == 30
    assert value(m, "vllm:num_preemptions_total") == 1
    assert value(m, "vllm:prefix_cache_queries_total") == 170
    assert value(m, "vllm:prefix_cache_hits_total") == 20
    # 6 steps seen in two snapshots: count and sum of the iteration histogram are exact.
    assert value(m, "vllm:iteration_tokens_total_count") == 6
    assert value(m, "vllm:iteration_tokens_total_sum") == 180


def test_engine_restart_never_makes_counters_go_back():
    m = Metrics("smol")
    m.update_from_engine_stats(EngineStats(generation_tokens=100, steps=10))
    m.update_from_engine_stats(EngineStats(generation_tokens=5, steps=1))  # restarted silently
    assert value(m, "vllm:generation_tokens_total") == 105
    m.engine_restarted()
    m.update_from_engine_stats(EngineStats(generation_tokens=7, steps=1))
    assert value(m, "vllm:generation_tokens_total") == 112
    assert value(m, "stoker:engine_restarts_total") == 1


def test_observe_finished_intervals_from_engine_timestamps():
    m = Metrics("smol")
    times = RequestTimes(
        arrival=10.0, scheduled=10.5, first_token=11.0, last_token=11.3, finished=11.3, token_times=[11.0, 11.1, 11.3]
    )
    m.observe_finished(times, prompt_tokens=40, generation_tokens=3, finish_reason="length")
    assert value(m, "vllm:request_success_total", finished_reason="length") == 1
    assert value(m, "vllm:time_to_first_token_seconds_sum") == 1.0
    assert value(m, "vllm:request_queue_time_seconds_sum") == 0.5
    assert abs(value(m, "vllm:e2e_request_latency_seconds_sum") - 1.3) < 1e-9
    assert value(m, "vllm:inter_token_latency_seconds_count") == 2
    assert abs(value(m, "vllm:inter_token_latency_seconds_sum") - 0.3) < 1e-9
    assert value(m, "vllm:request_prompt_tokens_sum") == 40
    assert value(m, "vllm:request_generation_tokens_sum") == 3


def test_request_that_never_ran_has_no_latency_samples():
    m = Metrics("smol")
    m.observe_finished(None, 5, 0, None)
    assert value(m, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(m, "vllm:time_to_first_token_seconds_count") == 0


def test_per_key_series_only_when_enabled():
    off = Metrics("smol")
    off.set_budget_remaining("k1", "alice", 10)
    assert not any(n.startswith("stoker:budget_remaining") for n, _ in samples(off))
    on = Metrics("smol", per_key_labels=True)
    on.set_budget_remaining("k1", "alice", 10)
    assert value(on, "stoker:budget_remaining_tokens", key_id="k1", key_name="alice") == 10


def test_registries_are_independent():
    a, b = Metrics("a"), Metrics("b")
    a.engine_restarted()
    assert value(b, "stoker:engine_restarts_total") == 0


def test_structured_output_counters_and_histograms_take_only_new_samples():
    m = Metrics("smol")
    m.update_from_engine_stats(
        EngineStats(
            constrained_requests=2,
            grammar_mask_steps=3,
            grammar_mask_seconds=[0.001, 0.002, 0.003],
            grammar_compiles=1,
            grammar_compile_seconds=[0.004],
        )
    )
    # The engine's window still holds the old values; only the 2 new steps are observed.
    m.update_from_engine_stats(
        EngineStats(
            constrained_requests=5,
            grammar_mask_steps=5,
            grammar_mask_seconds=[0.002, 0.003, 0.010, 0.020],
            grammar_compiles=1,
            grammar_compile_seconds=[0.004],
        )
    )
    assert value(m, "stoker:structured_requests_total", model_name="smol") == 5
    assert value(m, "stoker:grammar_mask_seconds_count", model_name="smol") == 5
    assert abs(value(m, "stoker:grammar_mask_seconds_sum", model_name="smol") - 0.036) < 1e-9
    assert value(m, "stoker:grammar_compile_seconds_count", model_name="smol") == 1


def test_kv_capacity_in_tokens_is_exported():
    m = Metrics("smol")
    m.update_from_engine_stats(EngineStats(kv_blocks_total=100, kv_blocks_used=25, block_size=16))
    assert value(m, "stoker:kv_cache_capacity_tokens", model_name="smol") == 1600


def test_speculative_decoding_counters_follow_the_engine():
    m = Metrics("smol")
    m.update_from_engine_stats(
        EngineStats(
            spec_drafts=3, spec_draft_tokens=12, spec_accepted_tokens=7, spec_accepted_per_position=[3, 2, 1, 1]
        )
    )
    m.update_from_engine_stats(
        EngineStats(
            spec_drafts=5, spec_draft_tokens=20, spec_accepted_tokens=9, spec_accepted_per_position=[5, 2, 1, 1]
        )
    )
    assert value(m, "vllm:spec_decode_num_drafts_total") == 5
    assert value(m, "vllm:spec_decode_num_draft_tokens_total") == 20
    assert value(m, "vllm:spec_decode_num_accepted_tokens_total") == 9
    per_position = [value(m, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(4)]
    assert per_position == [5, 2, 1, 1]
    # An engine restart starts its counters again from zero: nothing goes back.
    m.engine_restarted()
    m.update_from_engine_stats(EngineStats(spec_drafts=1, spec_draft_tokens=4, spec_accepted_tokens=4))
    assert value(m, "vllm:spec_decode_num_accepted_tokens_total") == 13


def test_disk_tier_counters_and_gauges_follow_the_engine():
    m = Metrics("smol")
    m.update_from_engine_stats(EngineStats(kv_disk_hits=3, kv_disk_bytes_written=1000, kv_disk_pending_writes=4))
    m.update_from_engine_stats(
        EngineStats(
            kv_disk_hits=5,
            kv_disk_misses=2,
            kv_disk_bytes_read=700,
            kv_disk_bytes_written=1500,
            kv_disk_evictions=1,
            kv_disk_corrupt_dropped=1,
            kv_disk_writes_dropped=6,
            kv_disk_bytes_used=9000,
            kv_disk_degraded="No space left on device",
        )
    )
    got = {
        name: value(m, name, model_name="smol")
        for name, _ in samples(m)
        if name.startswith("stoker:kv_disk") and not name.endswith("_created")
    }
    assert got == {
        "stoker:kv_disk_hits_total": 5,
        "stoker:kv_disk_misses_total": 2,
        "stoker:kv_disk_read_bytes_total": 700,
        "stoker:kv_disk_written_bytes_total": 1500,
        "stoker:kv_disk_evictions_total": 1,
        "stoker:kv_disk_corrupt_dropped_total": 1,
        "stoker:kv_disk_writes_dropped_total": 6,
        "stoker:kv_disk_pending_writes": 0,
        "stoker:kv_disk_used_bytes": 9000,
        "stoker:kv_disk_degraded": 1,
    }

"""Scheduler: token budget, running before waiting, chunked prefill, decodes
first, max_num_seqs, preemption (victim order, exact blocks freed, resume with
recompute and prefix hits), priority preemption of running requests, and n > 1
samples sharing their leader's blocks. Steps run as EngineCore.step runs them,
through the typed messages (SchedulerOutput -> ModelRunnerOutput ->
update_from_output), with a stand-in for the model that samples 7, 8, 9, ..."""

from __future__ import annotations

from dataclasses import dataclass

from stoker.engine.kv_cache import KVCacheManager
from stoker.engine.outputs import ModelRunnerOutput, SchedulerOutput
from stoker.engine.params import SamplingParams
from stoker.engine.request import Request, RequestStatus
from stoker.engine.scheduler import Scheduler

BS = 4


def make(
    num_blocks: int = 64,
    budget: int = 64,
    max_num_seqs: int = 16,
    policy: str = "priority",
    caching: bool = True,
) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BS, caching), budget, max_num_seqs, policy)


def req(
    rid: str,
    prompt: list[int] | int,
    arrival: float = 0.0,
    priority: int = 0,
    deadline: float | None = None,
    max_tokens: int = 100,
    index: int = 0,
    n: int = 1,
) -> Request:
    if isinstance(prompt, int):  # a distinct prompt of that length
        base = 1000 * (sum(map(ord, rid)) % 50 + 1)
        prompt = list(range(base, base + prompt))
    params = SamplingParams(n=n, max_tokens=max_tokens)
    return Request(
        rid, index, list(prompt), params, arrival, priority=priority, deadline=deadline, max_tokens=max_tokens
    )


@dataclass
class Step:
    out: SchedulerOutput
    plan: list[tuple[str, int]]
    """(name, num_new_tokens) in output order; name is request_id or request_id/index."""
    sampled: list[str]
    finished: list[str]
    tables: dict[str, list[int]]
    """Block tables of the scheduled requests as the runner saw them."""


def name(r: Request) -> str:
    return r.request_id if r.index == 0 else f"{r.request_id}/{r.index}"


def step(s: Scheduler) -> Step:
    """One engine step without a model: schedule, 'run', update from the output."""
    out = s.schedule()
    assert out.num_tokens <= s.max_num_batched_tokens
    assert len(s.running) <= s.max_num_seqs
    plan = [(name(s.requests[x.key]), x.num_new_tokens) for x in out.scheduled]
    tables = {name(s.requests[x.key]): x.block_ids for x in out.scheduled}
    for x in out.scheduled:
        r = s.requests[x.key]
        assert x.block_ids == s.kv.block_ids(r)
        assert x.token_ids == r.token_ids[x.num_computed_tokens : x.num_computed_tokens + x.num_new_tokens]
    sampling = [s.requests[x.key] for x in out.scheduled if x.samples]
    result = ModelRunnerOutput(
        sampled_keys=[r.key for r in sampling],
        sampled_token_ids=[[7 + r.num_output_tokens] for r in sampling],
        logprobs=[None for _ in sampling],
    )
    deltas = s.update_from_output(out, result)
    for x in out.scheduled:
        if x.key in s.requests:  # not finished by this step
            r = s.requests[x.key]
            assert r.num_computed_tokens == x.num_computed_tokens + x.num_new_tokens <= r.num_tokens
    finished = [name(r) for r, d in zip(sampling, deltas) if d.finished]
    return Step(out, plan, [name(r) for r in sampling], finished, tables)


def ref_counts(s: Scheduler, ids: list[int]) -> list[int]:
    return [s.kv.pool.blocks[i].ref_count for i in ids]


# -------------------------------------------------------------- budget, chunks


def test_nothing_to_do() -> None:
    s = make()
    out = s.schedule()
    assert out.scheduled == [] and out.preempted == [] and out.num_tokens == 0
    assert not s.has_unfinished()


def test_chunked_prefill_exact_chunks_and_blocks() -> None:
    s = make(budget=6)
    a = req("a", 14)
    s.add(a)
    st = step(s)
    assert st.plan == [("a", 6)] and st.sampled == []
    assert s.kv.block_ids(a) == [1, 2]
    assert a.num_cached_tokens == 0 and a.status == RequestStatus.RUNNING
    st = step(s)
    assert st.plan == [("a", 6)] and st.sampled == []
    assert s.kv.block_ids(a) == [1, 2, 3]
    st = step(s)
    assert st.plan == [("a", 2)] and st.sampled == ["a"]
    assert s.kv.block_ids(a) == [1, 2, 3, 4]
    assert a.num_computed_tokens == 14 and a.num_tokens == 15
    st = step(s)
    assert st.plan == [("a", 1)] and st.sampled == ["a"]
    assert s.kv.block_ids(a) == [1, 2, 3, 4]
    # The fully computed blocks are registered as they fill.
    assert s.kv.num_hashed[a.key] == 3


def test_token_budget_is_shared_running_first_then_waiting() -> None:
    s = make(budget=10)
    a = req("a", 12, arrival=0.0)
    s.add(a)
    assert step(s).plan == [("a", 10)]
    b = req("b", 9, arrival=1.0)
    c = req("c", 9, arrival=2.0)
    s.add(b)
    s.add(c)
    # a (running) finishes its prompt first; b gets the rest of the budget; c none.
    st = step(s)
    assert st.plan == [("a", 2), ("b", 8)]
    assert st.sampled == ["a"]
    assert [name(r) for r in s.waiting] == ["c"]
    # Decodes first; b finishes its prompt; c gets what is left.
    st = step(s)
    assert st.plan == [("a", 1), ("b", 1), ("c", 8)]
    assert st.sampled == ["a", "b"]
    st = step(s)
    assert st.plan == [("a", 1), ("b", 1), ("c", 1)]
    assert st.out.num_tokens == 3


def test_budget_exhausted_by_running_leaves_waiting_alone() -> None:
    s = make(budget=4)
    a, b = req("a", 9, arrival=0.0), req("b", 3, arrival=1.0)
    s.add(a)
    s.add(b)
    assert step(s).plan == [("a", 4)]
    assert step(s).plan == [("a", 4)]
    assert b.status == RequestStatus.WAITING and b.times.scheduled is None
    assert step(s).plan == [("a", 1), ("b", 3)]
    assert b.times.scheduled is not None


def test_decodes_come_before_prefill_chunks_in_the_output() -> None:
    s = make(budget=10)
    low = req("low", 3, arrival=0.0, priority=1)
    s.add(low)
    assert step(s).plan == [("low", 3)]
    high = req("high", 15, arrival=1.0, priority=0)
    s.add(high)
    assert step(s).plan == [("low", 1), ("high", 9)]
    # Now running is served as [high, low]; the output still puts the decode first.
    st = step(s)
    assert st.plan == [("low", 1), ("high", 6)]
    assert [s.requests[x.key] for x in st.out.scheduled] == [low, high]


def test_max_num_seqs() -> None:
    s = make(max_num_seqs=2, policy="fcfs")
    a = req("a", 3, arrival=0.0, max_tokens=2)
    b = req("b", 3, arrival=1.0)
    c = req("c", 3, arrival=2.0)
    for r in (a, b, c):
        s.add(r)
    st = step(s)
    assert st.plan == [("a", 3), ("b", 3)]
    assert len(s.running) == 2 and [name(r) for r in s.waiting] == ["c"]
    st = step(s)
    assert st.plan == [("a", 1), ("b", 1)]
    assert st.finished == ["a"]
    assert step(s).plan == [("b", 1), ("c", 3)]


def test_remove_waiting_and_running() -> None:
    s = make()
    a, b = req("a", 5, arrival=0.0), req("b", 5, arrival=1.0)
    s.add(a)
    s.add(b)
    s.remove(b)  # aborted while waiting
    assert list(s.waiting) == [a]
    step(s)
    assert s.kv.num_used_blocks == 2
    s.remove(a)  # aborted while running
    assert s.running == [] and s.kv.num_used_blocks == 0
    assert not s.has_unfinished()


# ------------------------------------------------------------------ preemption


def three_running(
    policy: str, priorities: tuple[int, int, int] = (0, 0, 0)
) -> tuple[Scheduler, Request, Request, Request]:
    """bs 4, usable blocks 1..7; three 7-token prompts hold [1,2], [3,4], [5,6]
    after one step and fill their second block after the next."""
    s = make(num_blocks=8, policy=policy)
    a = req("a", 7, arrival=0.0, priority=priorities[0], max_tokens=3)
    b = req("b", 7, arrival=1.0, priority=priorities[1])
    c = req("c", 7, arrival=2.0, priority=priorities[2])
    for r in (a, b, c):
        s.add(r)
    st = step(s)
    assert sorted(st.plan) == [("a", 7), ("b", 7), ("c", 7)]
    # Admitted in service order: by arrival, or with a last when it has priority 1.
    first = [[1, 2], [3, 4], [5, 6]] if priorities[0] == 0 or policy == "fcfs" else [[5, 6], [1, 2], [3, 4]]
    assert [s.kv.block_ids(r) for r in (a, b, c)] == first
    assert len(step(s).plan) == 3  # position 7: still in the second block
    assert list(s.kv.pool.free_queue) == [7]
    return s, a, b, c


def test_preemption_picks_latest_arrival_frees_its_blocks_and_it_resumes_with_prefix_hit() -> None:
    s, _a, _b, c = three_running("fcfs")
    st = step(s)  # position 8 needs a third block for everyone; one is free
    assert st.plan == [("a", 1), ("b", 1)]
    assert st.out.preempted == [c.key]
    assert st.tables == {"a": [1, 2, 7], "b": [3, 4, 6]}  # b gets c's tail block, freed first
    assert s.kv.block_ids(c) == []
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and s.num_preemptions == 1
    assert [name(r) for r in s.waiting] == ["c"]
    assert st.finished == ["a"]  # a's 3rd token: its blocks go back tail first
    assert list(s.kv.pool.free_queue) == [5, 7, 2, 1]
    assert ref_counts(s, [5]) == [0] and s.kv.pool.blocks[5].block_hash is not None

    queries, hits = s.kv.prefix_queries, s.kv.prefix_hits
    st = step(s)
    # c recomputes all 9 tokens (7 prompt + 2 generated) but its first block
    # (id 5, still cached in the free queue) is a hit: 4 cached + 5 new.
    assert st.plan == [("b", 1), ("c", 5)]
    assert st.sampled == ["b", "c"]
    assert s.kv.block_ids(c) == [5, 7, 2]
    assert c.num_computed_tokens == 9 and c.num_output_tokens == 3
    assert c.num_cached_tokens == 0  # what the first scheduling found
    # A resumed request is not counted again in the prefix-cache statistics.
    assert (s.kv.prefix_queries, s.kv.prefix_hits) == (queries, hits)


def test_preemption_picks_lowest_priority_before_latest_arrival() -> None:
    s, a, b, c = three_running("priority", priorities=(1, 0, 0))
    st = step(s)
    assert st.out.preempted == [a.key]
    assert st.plan == [("b", 1), ("c", 1)]
    assert s.kv.block_ids(a) == []
    assert s.kv.block_ids(b) == [1, 2, 7]
    assert s.kv.block_ids(c) == [3, 4, 6]  # a's blocks go back tail first: 6, then 5
    assert list(s.kv.pool.free_queue) == [5]
    assert s.kv.pool.blocks[5].block_hash is not None  # a's head stays cached
    assert a.status == RequestStatus.PREEMPTED and a.num_computed_tokens == 0


def test_a_request_can_preempt_itself() -> None:
    """The worst running request that cannot grow goes back to waiting itself,
    and no waiting request is admitted in that step."""
    s = make(num_blocks=4, budget=64)  # usable 1..3
    a = req("a", 7, arrival=0.0)
    b = req("b", 3, arrival=1.0)
    s.add(a)
    s.add(b)
    assert step(s).plan == [("a", 7), ("b", 3)]
    assert step(s).plan == [("a", 1), ("b", 1)]  # b's position 3 still in block 3
    late = req("late", 2, arrival=2.0)
    s.add(late)
    st = step(s)  # a (pos 8) and b (pos 4) both need a block; none free
    assert st.out.preempted == [b.key]
    assert st.plan == [("a", 1)]
    assert s.kv.block_ids(a) == [1, 2, 3]
    assert late.status == RequestStatus.WAITING


def test_preempted_victim_already_scheduled_this_step_returns_its_budget() -> None:
    s = make(num_blocks=5, budget=64, policy="fcfs")  # usable 1..4
    a = req("a", 3, arrival=0.0, priority=0)
    b = req("b", 3, arrival=1.0, priority=0)
    c = req("c", 3, arrival=2.0, priority=0)
    for r in (a, b, c):
        s.add(r)
    step(s)  # blocks [1], [2], [3]
    st = step(s)  # position 3 fits
    assert st.plan == [("a", 1), ("b", 1), ("c", 1)]
    assert s.kv.pool.num_free == 1
    st = step(s)  # position 4: a takes block 4, b preempts c
    assert st.out.preempted == [c.key]
    assert st.plan == [("a", 1), ("b", 1)]
    assert st.out.num_tokens == 2


# ------------------------------------------------- priority policy preemption


def one_low_priority_holding_everything(policy: str, high_priority: int) -> tuple[Scheduler, Request, Request]:
    s = make(num_blocks=5, policy=policy)  # usable 1..4
    low = req("low", 15, arrival=0.0, priority=1)
    s.add(low)
    assert step(s).plan == [("low", 15)]
    assert s.kv.block_ids(low) == [1, 2, 3, 4] and s.kv.pool.num_free == 0
    high = req("high", 3, arrival=1.0, priority=high_priority)
    s.add(high)
    return s, low, high


def test_waiting_higher_priority_preempts_running_lower_priority_for_blocks() -> None:
    s, low, high = one_low_priority_holding_everything("priority", high_priority=0)
    st = step(s)
    assert st.out.preempted == [low.key]
    assert st.plan == [("high", 3)]  # low's decode was withdrawn
    assert s.kv.block_ids(high) == [4]  # low's tail block, freed first
    assert low.status == RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    assert [name(r) for r in s.waiting] == ["low"]
    assert list(s.kv.pool.free_queue) == [3, 2, 1]


def test_waiting_equal_priority_never_preempts_running() -> None:
    s, _low, high = one_low_priority_holding_everything("priority", high_priority=1)
    st = step(s)
    assert st.out.preempted == []
    assert st.plan == [("low", 1)]
    assert high.status == RequestStatus.WAITING


def test_fcfs_never_preempts_running_for_waiting() -> None:
    s, _low, high = one_low_priority_holding_everything("fcfs", high_priority=0)
    st = step(s)
    assert st.out.preempted == []
    assert st.plan == [("low", 1)]
    assert high.status == RequestStatus.WAITING


def test_waiting_higher_priority_preempts_when_max_num_seqs_is_full() -> None:
    s = make(max_num_seqs=2)
    a = req("a", 3, arrival=0.0, priority=0)
    low = req("low", 3, arrival=1.0, priority=1)
    s.add(a)
    s.add(low)
    step(s)
    same = req("same", 3, arrival=2.0, priority=1)
    s.add(same)
    st = step(s)
    assert st.out.preempted == [] and st.plan == [("a", 1), ("low", 1)]
    high = req("high", 3, arrival=3.0, priority=0)
    s.add(high)
    st = step(s)
    assert st.out.preempted == [low.key]
    assert st.plan == [("a", 1), ("high", 3)]
    assert st.out.num_tokens == 4
    assert s.kv.block_ids(low) == []
    assert [name(r) for r in s.waiting] == ["low", "same"]  # low keeps its place
    assert sorted(name(r) for r in s.running) == ["a", "high"]


# ------------------------------------------------------------------ n > 1


def test_samples_wait_for_the_leaders_prefill_then_share_its_blocks() -> None:
    s = make(budget=16)
    prompt = list(range(500, 510))  # 10 tokens: 2 full blocks
    samples = [req("r", prompt, arrival=0.0, index=i, n=3) for i in range(3)]
    for r in samples:
        s.add(r)
    leader, s1, s2 = samples
    st = step(s)
    assert st.plan == [("r", 10)]  # budget left, but 1 and 2 wait for the leader
    assert s.kv.block_ids(leader) == [1, 2, 3]
    st = step(s)
    assert st.plan == [("r", 1), ("r/1", 2), ("r/2", 2)]
    assert s.kv.block_ids(s1) == [1, 2, 4]
    assert s.kv.block_ids(s2) == [1, 2, 5]
    assert ref_counts(s, [1, 2, 3, 4, 5]) == [3, 3, 1, 1, 1]
    assert s1.num_cached_tokens == 8 and s2.num_cached_tokens == 8
    assert leader.num_cached_tokens == 0
    assert (s.kv.prefix_queries, s.kv.prefix_hits) == (30, 16)
    assert s.kv.num_used_blocks == 5
    s.remove(s1)
    assert ref_counts(s, [1, 2, 4]) == [2, 2, 0]


def test_samples_wait_across_a_chunked_leader_prefill() -> None:
    s = make(budget=6)
    prompt = list(range(600, 610))
    samples = [req("r", prompt, index=i, n=2) for i in range(2)]
    other = req("other", 2, arrival=1.0)
    for r in (*samples, other):
        s.add(r)
    # Sample 1 waits while the leader is chunked; a later request may pass it.
    assert step(s).plan == [("r", 6)]
    assert step(s).plan == [("r", 4), ("other", 2)]
    assert samples[1].status == RequestStatus.WAITING
    st = step(s)
    assert st.plan == [("r", 1), ("other", 1), ("r/1", 2)]
    assert s.kv.block_ids(samples[1])[:2] == s.kv.block_ids(samples[0])[:2]
    assert ref_counts(s, s.kv.block_ids(samples[0])[:2]) == [2, 2]


def test_prefix_stats_and_num_cached_tokens() -> None:
    s = make()
    prompt = list(range(700, 709))  # 9 tokens: 2 full blocks
    a = req("a", prompt, arrival=0.0, max_tokens=1)
    s.add(a)
    assert step(s).finished == ["a"]
    b = req("b", prompt, arrival=1.0)
    s.add(b)
    st = step(s)
    assert st.plan == [("b", 1)]
    assert b.num_cached_tokens == 8
    assert s.kv.block_ids(b) == [1, 2, 4]  # a's blocks 1, 2 reused; its tail (3) not
    assert (s.kv.prefix_queries, s.kv.prefix_hits) == (18, 8)


def test_no_prefix_caching_recomputes_everything() -> None:
    s = make(caching=False)
    prompt = list(range(700, 709))
    a = req("a", prompt, max_tokens=1)
    s.add(a)
    step(s)
    b = req("b", prompt, arrival=1.0)
    s.add(b)
    assert step(s).plan == [("b", 9)]
    assert b.num_cached_tokens == 0
    assert (s.kv.prefix_queries, s.kv.prefix_hits) == (0, 0)


# ---------------------------------------------------- review fixes, pinned


def test_fcfs_victim_is_latest_arrival_whatever_its_priority() -> None:
    s, a, _b, c = three_running("fcfs", priorities=(1, 0, 0))
    st = step(s)
    assert st.out.preempted == [c.key]  # fcfs ignores the priority field
    assert a.num_preemptions == 0


def test_deadline_does_not_make_a_running_request_the_victim() -> None:
    """Deadlines order the waiting queue; the victim is still the latest arrival."""
    s = make(num_blocks=8, policy="priority")
    a = req("a", 7, arrival=0.0, max_tokens=3)
    b = req("b", 7, arrival=1.0, deadline=1e12)
    c = req("c", 7, arrival=2.0, deadline=5.0)  # earliest deadline, latest arrival
    for r in (a, b, c):
        s.add(r)
    step(s)
    step(s)
    assert step(s).out.preempted == [c.key]


def test_no_preemption_when_it_would_not_make_room() -> None:
    """A higher-priority request that would not fit even after preempting every
    lower-priority request preempts none of them."""
    s = make(num_blocks=7, max_num_seqs=2)  # usable 1..6
    big = req("big", 16, arrival=0.0, priority=0)
    small = req("small", 3, arrival=1.0, priority=1)
    s.add(big)
    s.add(small)
    step(s)
    assert s.kv.pool.num_free == 1
    huge = req("huge", 12, arrival=2.0, priority=0)  # needs 3 blocks; small frees only 1
    s.add(huge)
    st = step(s)
    assert st.out.preempted == []
    assert small.status == RequestStatus.RUNNING and huge.status == RequestStatus.WAITING


def test_running_decodes_are_not_stalled_by_a_higher_ranked_chunked_prefill() -> None:
    s = make(budget=8)
    low = req("low", 3, arrival=0.0, priority=1)
    s.add(low)
    step(s)
    high = req("high", 40, arrival=1.0, priority=0)
    s.add(high)
    step(s)  # high starts its chunked prefill
    for _ in range(3):
        st = step(s)
        assert ("low", 1) in st.plan
        assert st.plan[0] == ("low", 1)  # the decode goes first, the chunk takes the rest
        assert st.out.num_tokens == 8


# ------------------------------------------------------- the step's messages


def test_schedule_moves_no_progress_update_from_output_does() -> None:
    s = make(budget=64)
    a = req("a", 12)
    s.add(a)
    step(s)  # a's 3 full blocks are now cached
    b = req("b", list(a.prompt_token_ids) + [5, 6])
    s.add(b)
    out = s.schedule()
    (x,) = [x for x in out.scheduled if x.key == b.key]
    # The 12-token prefix is a hit: the chunk starts at 12, but b has computed nothing yet.
    assert x.num_computed_tokens == 12 and x.token_ids == [5, 6] and x.samples
    assert b.num_computed_tokens == 0 and b.num_output_tokens == 0
    sampled = [x.key for x in out.scheduled if x.samples]
    s.update_from_output(out, ModelRunnerOutput(sampled, [[9] for _ in sampled], [None for _ in sampled]))
    assert b.num_computed_tokens == 14 and b.output_token_ids == [9]


def test_update_takes_several_tokens_per_sequence_and_stops_at_max_tokens() -> None:
    s = make()
    a = req("a", 5, max_tokens=3)
    s.add(a)
    out = s.schedule()
    (delta,) = s.update_from_output(out, ModelRunnerOutput([a.key], [[11, 12, 13, 14]], [None]))
    # Room for speculative decoding: all accepted tokens land, up to max_tokens.
    assert a.output_token_ids == [11, 12, 13] and delta.new_token_ids == [11, 12, 13]
    assert delta.finish_reason is not None and delta.finish_reason.value == "length"
    assert not s.has_unfinished() and s.kv.num_used_blocks == 0


def test_prompt_logprob_request_computes_its_whole_prompt_in_chunks() -> None:
    s = make(budget=6)
    a = req("a", 12)
    s.add(a)
    for _ in range(2):
        step(s)  # 12 prompt tokens in two chunks; blocks cached
    prompt = list(a.prompt_token_ids)
    scored = Request("p", 0, prompt, SamplingParams(max_tokens=0, prompt_logprobs=2), 0.0, max_tokens=0)
    s.add(scored)
    seen = []
    while scored.key in s.requests:
        out = s.schedule()
        for x in out.scheduled:
            if x.key == scored.key:
                seen.append((x.num_computed_tokens, x.prompt_logprob_targets, x.num_prompt_logprobs))
        sampled = [x.key for x in out.scheduled if x.samples]
        s.update_from_output(out, ModelRunnerOutput(sampled, [[9] for _ in sampled], [None for _ in sampled]))
    # No prefix-cache hit (it would skip positions); each chunk predicts the next prompt tokens.
    # (a still decodes one token a step, so the chunks are 5, 5 and 2 tokens.)
    assert seen == [(0, prompt[1:6], 2), (5, prompt[6:11], 2), (10, prompt[11:12], 2)]
    assert scored.output_token_ids == [] and scored.finish_reason is not None

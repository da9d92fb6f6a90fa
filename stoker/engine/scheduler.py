"""Token-budget scheduler: no prefill or decode phase, only requests catching up
with their token lists under a per-step budget.

Each step: running requests first (in service order), then waiting ones while
budget, sequence slots and KV blocks last. A long prompt is chunked across
steps. When blocks run out the worst request by service order is preempted
(freed and recomputed later); with the priority policy a waiting request may
also preempt a running one of a strictly lower class.

schedule() says what to compute (a SchedulerOutput, stoker/engine/outputs.py);
update_from_output() turns what the runner computed into request progress.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, deque

import torch

from stoker.engine.kv_cache import Block, KVCacheManager
from stoker.engine.kv_disk_tier import DiskTier, Fetch
from stoker.engine.kv_transfer_fetch import PeerFetch
from stoker.engine.kv_transfer_rooms import KVSender
from stoker.engine.lora_registry import LoraRegistry
from stoker.engine.outputs import ModelRunnerOutput, RequestKey, ScheduledRequest, SchedulerOutput
from stoker.engine.params import EngineCoreOutput, FinishReason
from stoker.engine.queues import POLICIES, make_queue
from stoker.engine.request import Request, RequestStatus
from stoker.engine.sampler import SampleRow, prepare
from stoker.engine.spec.speculator import Speculator
from stoker.models.lora import LoraAdapter

RECENT_STEPS = 256
"""Per-step timings kept for the metrics poller, which reads them every second or so."""


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        policy: str = "priority",
        eos_token_ids: frozenset[int] = frozenset(),
        max_model_len: int = 2**31,
        speculator: Speculator | None = None,
        disk: DiskTier | None = None,
        loras: LoraRegistry | None = None,
        max_loras: int = 4,
        peers: PeerFetch | None = None,
        sender: KVSender | None = None,
    ) -> None:
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.policy = policy
        self.eos_token_ids = eos_token_ids
        self._eos_list = sorted(eos_token_ids)
        self.max_model_len = max_model_len
        self.speculator = speculator
        self.disk = disk
        """The prefix cache's disk tier (--kv-cache-disk): waiting requests' blocks are read from it."""
        self.loras = loras
        """LoRA adapters: a waiting request's adapter is made resident before it is admitted."""
        self.max_loras = max_loras
        """Distinct adapters among running requests (--max-loras)."""
        self.peers = peers
        """A decode worker's pulls (kv_role decode): split requests' prompt blocks come from their prefill worker."""
        self.sender = sender
        """A prefill worker's rooms (kv_role prefill): split requests' prompt blocks are parked for a decode worker."""
        self.waiting = make_queue(policy)
        self.service_key, self.victim_key = POLICIES[policy]
        self.running: list[Request] = []
        self.requests: dict[RequestKey, Request] = {}
        """Every sequence added and not yet removed, by key."""
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        """Prompt tokens of sequences that sampled their first token (cumulative)."""
        self.num_generation_tokens = 0
        self.num_mask_steps = 0
        """Steps in which constrained sequences sampled (cumulative)."""
        self.mask_seconds: deque[float] = deque(maxlen=RECENT_STEPS)
        """Time spent computing grammar bitmasks in each of the latest such steps."""
        self._step_mask_seconds = 0.0
        self._arrivals = itertools.count()

    def add(self, request: Request) -> None:
        request.arrival_seq = next(self._arrivals)
        if request.prepared is None:
            request.prepared = prepare(request.params, self._eos_list)
        request.status = RequestStatus.WAITING
        self.requests[request.key] = request
        self.waiting.add(request)

    def remove(self, request: Request) -> None:
        """Take a request out of the scheduler (finished or aborted) and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        self.requests.pop(request.key, None)
        if self.sender is not None:
            self.sender.on_remove(request)  # parks what it computed last, before its blocks are freed
        self.kv.free(request)
        if self.speculator is not None:
            self.speculator.forget(request.key)
        if self.disk is not None:
            self.disk.forget(request.key)
        if self.peers is not None:
            self.peers.forget(request.key)

    def abort(self, request: Request, error: str | None = None) -> EngineCoreOutput:
        """Finish a sequence from outside the step (cancel, deadline, drain)."""
        self.remove(request)
        request.finish(FinishReason.ABORT, error=error)
        return request.take_delta()

    def has_unfinished(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    def _preempt(self, victim: Request, out: SchedulerOutput, budget: list[int]) -> None:
        """Free the victim and roll its progress back to nothing: it recomputes
        later. The one change to progress outside update_from_output, and a
        rollback: its blocks are gone this instant."""
        self.running.remove(victim)
        for i, s in enumerate(out.scheduled):
            if s.key == victim.key:
                budget[0] += s.num_new_tokens
                del out.scheduled[i]
                break
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = RequestStatus.PREEMPTED
        self.waiting.add(victim)
        self.num_preemptions += 1
        out.preempted.append(victim.key)

    def _scheduled(
        self,
        request: Request,
        num_computed: int,
        num_new: int,
        drafts: list[int] | None = None,
        bitmasks: list[torch.Tensor] | None = None,
    ) -> ScheduledRequest:
        """Snapshot what the runner needs; called once the request's blocks are
        allocated. `bitmasks`: a constrained sequence's masks already computed
        while checking its drafts (one per sampled position)."""
        drafts = drafts or []
        end = num_computed + num_new
        sampling = None
        draft_bitmasks: list[torch.Tensor] = []
        if end == request.num_tokens:
            bitmask = None
            if request.grammar is not None and bitmasks:
                bitmask, draft_bitmasks = bitmasks[0], bitmasks[1 : 1 + len(drafts)]
            elif request.reasoning is not None:
                # Forced marker tokens, and the grammar only once the answer starts.
                started = time.perf_counter()
                bitmask = request.reasoning.state.step_bitmask(request.grammar)
                if request.grammar is not None:
                    self._step_mask_seconds += time.perf_counter() - started
            elif request.grammar is not None:
                started = time.perf_counter()
                bitmask = request.grammar.next_bitmask()
                self._step_mask_seconds += time.perf_counter() - started
            sampling = SampleRow(
                request.params,
                request.prompt_token_ids,
                request.output_token_ids,
                request.generator,
                self._eos_list,
                bitmask,
                request.prepared,
            )
        targets: list[int] = []
        if request.needs_prompt_logprobs:
            # The last prompt position predicts the first output token, not a prompt token.
            targets = request.prompt_token_ids[num_computed + 1 : min(end + 1, request.num_prompt_tokens)]
        return ScheduledRequest(
            key=request.key,
            lora=self._adapter(request),
            token_ids=request.token_ids[num_computed:end] + drafts,
            num_computed_tokens=num_computed,
            block_ids=self.kv.block_ids(request),
            sampling=sampling,
            num_prompt_logprobs=request.params.prompt_logprobs if targets else None,
            prompt_logprob_targets=targets,
            num_draft_tokens=len(drafts),
            draft_bitmasks=draft_bitmasks,
        )

    def _adapter(self, request: Request) -> LoraAdapter | None:
        if request.lora_name is None:
            return None
        resident = self.loras.resident(request.lora_name) if self.loras is not None else None
        if resident is None:  # admission made it resident and running requests' adapters are never evicted
            raise RuntimeError(f"LoRA adapter {request.lora_name!r} of a scheduled request is not in memory")
        return resident.adapter

    def loras_in_use(self) -> set[str]:
        """Adapters of running requests: never evicted, and at most max_loras of them."""
        return {r.lora_name for r in self.running if r.lora_name is not None}

    def lora_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """Running and waiting sequences by adapter (vllm:lora_requests_info)."""
        running = Counter(r.lora_name for r in self.running if r.lora_name is not None)
        waiting = Counter(r.lora_name for r in self.waiting if r.lora_name is not None)
        return dict(running), dict(waiting)

    def _drafts(self) -> tuple[dict[RequestKey, list[int]], dict[RequestKey, list[torch.Tensor]]]:
        """Speculative tokens for this step's decoding sequences: never past a
        sequence's max_tokens (the last position of a step always yields one
        token of the model's own) or the context. A grammar-constrained
        sequence's guesses are cut at the first one its grammar refuses, and
        the second dict holds its mask for each position the step would
        sample (SequenceGrammar.check_drafts). Empty when the speculator is
        off or the step is too full for it."""
        if self.speculator is None:
            return {}, {}
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        if not self.speculator.step_allows(len(decoding)):
            return {}, {}
        wanted = []
        for r in decoding:
            limit = min(r.max_tokens - r.num_output_tokens - 1, self.max_model_len - r.num_tokens - 1)
            asked = r.params.num_speculative_tokens
            if asked is not None:
                limit = min(limit, asked)
            if r.reasoning is not None and not r.reasoning.state.may_draft:
                limit = 0
            if limit > 0:
                wanted.append((r.key, r.token_ids, limit))
        drafts = self.speculator.drafts(wanted)
        masks: dict[RequestKey, list[torch.Tensor]] = {}
        for key, guesses in drafts.items():
            request = self.requests[key]
            grammar = request.grammar
            if request.reasoning is not None and not request.reasoning.state.answering:
                # Thinking: unconstrained, up to where the budget or the answer's grammar needs a mask.
                drafts[key] = guesses[: request.reasoning.state.drafts_within_phase(guesses, grammar is not None)]
            elif grammar is not None:
                started = time.perf_counter()
                checked = grammar.check_drafts(guesses, self.eos_token_ids)
                self._step_mask_seconds += time.perf_counter() - started
                drafts[key] = checked.token_ids
                masks[key] = checked.bitmasks
        return drafts, masks

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._step_mask_seconds = 0.0
        budget = [self.max_num_batched_tokens]
        # Decodes before prefill chunks, so a long prompt never stalls token streams.
        self.running.sort(key=lambda r: (r.num_tokens - r.num_computed_tokens > 1, self.service_key(r)))

        all_drafts, all_masks = self._drafts()
        for request in list(self.running):
            if request not in self.running:
                continue  # preempted earlier in this loop
            num_new = min(request.num_tokens - request.num_computed_tokens, budget[0])
            if num_new <= 0:
                continue
            drafts = all_drafts.get(request.key, [])[: budget[0] - 1]
            masks = all_masks.get(request.key)  # only for a decode: its first is this step's mask
            # Drafts only take free blocks: never preempt anyone for a guess.
            if drafts and num_new == 1 and self.kv.allocate(request, 1 + len(drafts)):
                out.scheduled.append(self._scheduled(request, request.num_computed_tokens, 1, drafts, masks))
                budget[0] -= 1 + len(drafts)
                continue
            while not self.kv.allocate(request, num_new):
                victim = max(self.running, key=self.victim_key)
                self._preempt(victim, out, budget)
                if victim is request:
                    break
            else:
                out.scheduled.append(self._scheduled(request, request.num_computed_tokens, num_new, bitmasks=masks))
                budget[0] -= num_new

        if not out.preempted:
            self._schedule_waiting(out, budget)
        # Decodes first so the runner can batch them in one attention call.
        out.scheduled.sort(key=lambda s: not s.is_decode)
        if self._step_mask_seconds:
            self.mask_seconds.append(self._step_mask_seconds)
            self.num_mask_steps += 1
        return out

    def _leader_prefilling(self, request: Request) -> bool:
        """Samples 1..n-1 of a prompt wait for sample 0's prefill, to share its blocks."""
        if request.index == 0 or request.num_computed_tokens:
            return False
        if self.peers is not None and self.peers.pulling((request.request_id, 0)):
            return True  # sample 0's prompt blocks are on their way from its prefill worker
        for other in self.running:
            if other.request_id == request.request_id and other.index == 0:
                return other.num_computed_tokens < other.num_prompt_tokens
        return False

    def _schedule_waiting(self, out: SchedulerOutput, budget: list[int]) -> None:
        now = time.time()
        adapters = self.loras_in_use()
        adapter_held = False
        for request in self.waiting:
            if budget[0] <= 0:
                break
            if self._leader_prefilling(request):
                continue
            if request.lora_name is not None and (adapter_held or not self._adapter_ready(request, adapters)):
                # Held back by --max-loras, later adapter requests wait behind it (base ones go on),
                # so the adapters in use drain and it never starves.
                adapter_held = adapter_held or request.lora_name not in adapters
                continue
            cached: list[Block] = []
            if request.num_computed_tokens == 0 and not request.needs_prompt_logprobs:
                cached = self.kv.find_cached_prefix(request)
                fetched = Fetch.NOTHING
                if self.peers is not None and request.kv_transfer is not None:
                    fetched = self.peers.fetch(request, cached)
                elif self.disk is not None:
                    fetched = self.disk.fetch(request, cached)
                if fetched is Fetch.WAITING:
                    continue  # its blocks are being read from disk or pulled from a peer; the others go ahead
                if fetched is Fetch.LOADED:
                    cached = self.kv.find_cached_prefix(request)
            computed = request.num_computed_tokens + len(cached) * self.kv.block_size
            num_new = min(request.num_tokens - computed, budget[0])
            slots_full = len(self.running) >= self.max_num_seqs
            if slots_full or not self.kv.can_allocate(request, num_new, cached):
                if not self._preempt_for(request, num_new, cached, out, budget, need_slot=slots_full):
                    break
                num_new = min(num_new, budget[0])
            if not self.kv.allocate(request, num_new, cached):
                break
            hit_tokens = len(cached) * self.kv.block_size
            if self.kv.enable_caching and request.num_preemptions == 0:
                self.kv.record_prefix_lookup(request.num_tokens, hit_tokens)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = hit_tokens
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            if request.times.scheduled is None:
                request.times.scheduled = now
            self.running.append(request)
            out.scheduled.append(self._scheduled(request, computed, num_new))
            budget[0] -= num_new

    def _adapter_ready(self, request: Request, adapters: set[str]) -> bool:
        """Whether the request's adapter may join this step (adding it to `adapters`, the step's
        adapters and those loading for it) and is in memory; a load starts here when it is not."""
        name = request.lora_name
        assert name is not None and self.loras is not None
        if name not in adapters and len(adapters) >= self.max_loras:
            return False
        adapters.add(name)
        resident = self.loras.ensure(name, adapters)
        if resident is None:
            return False  # loading: the request waits, the others go ahead
        request.hash_root = resident.hash_root
        return True

    def _preempt_for(
        self,
        request: Request,
        num_new: int,
        cached: list[Block],
        out: SchedulerOutput,
        budget: list[int],
        need_slot: bool,
    ) -> bool:
        """With the priority policy, preempt running requests of a strictly lower
        class until `request` fits. Preempts nothing unless that is enough."""
        if self.policy != "priority":
            return False
        candidates = sorted(
            (r for r in self.running if r.priority > request.priority), key=self.victim_key, reverse=True
        )
        cached_ids = {b.block_id for b in cached}
        needed = self.kv.blocks_needed(request, num_new, cached) + sum(1 for b in cached if b.ref_count == 0)
        available = self.kv.pool.num_free
        victims: list[Request] = []
        for victim in candidates:
            if available >= needed and (victims or not need_slot):
                break
            victims.append(victim)
            # Blocks only the victim holds come back; shared ones stay in use.
            available += sum(
                1 for b in self.kv.req_blocks.get(victim.key, []) if b.ref_count == 1 and b.block_id not in cached_ids
            )
        if available < needed or (need_slot and not victims):
            return False
        for victim in victims:
            self._preempt(victim, out, budget)
        return True

    # ------------------------------------------------------------- progress

    def update_from_output(self, step: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """The one place a step's work becomes request progress: computed
        tokens advance (prefix-cache hits included), full blocks are hashed
        for the prefix cache, prompt logprobs and sampled tokens are appended,
        stop conditions finish sequences. Returns one delta per sampled sequence."""
        drafted: dict[RequestKey, int] = {}
        for s in step.scheduled:
            r = self.requests[s.key]
            r.num_computed_tokens = s.num_computed_tokens + s.num_new_tokens
            if s.num_draft_tokens:
                # Hashed once the accepted drafts are appended (below): the blocks
                # must be keyed by the tokens that stay, not by rejected guesses.
                drafted[s.key] = s.num_draft_tokens
            else:
                self.kv.cache_full_blocks(r, r.num_computed_tokens)
            scored = result.prompt_logprobs.get(s.key)
            if scored:
                # scored[0] is prompt token num_computed_tokens + 1; after a
                # preemption the recomputed prefix is already in the list.
                already = len(r.prompt_logprobs) - (s.num_computed_tokens + 1)
                if already >= 0:
                    r.prompt_logprobs.extend(scored[already:])
        now = time.time()
        outputs = []
        for key, token_ids, logprobs in zip(result.sampled_keys, result.sampled_token_ids, result.logprobs):
            r = self.requests[key]
            num_drafts = drafted.get(key, 0)
            if num_drafts:
                accepted = len(token_ids) - 1
                # KV of rejected drafts sits past num_computed_tokens, in slots the
                # next tokens overwrite; the blocks stay with the sequence.
                r.num_computed_tokens -= num_drafts - accepted
                r.num_draft_tokens += num_drafts
                r.num_accepted_draft_tokens += accepted
                if self.speculator is not None:
                    self.speculator.record(key, num_drafts, accepted)
            if r.num_output_tokens == 0:
                self.num_prompt_tokens += r.num_prompt_tokens
            if r.max_tokens == 0:  # the prompt only (scored for prompt_logprobs): nothing to keep
                r.finish(FinishReason.LENGTH)
                token_ids = []
            for i, token in enumerate(token_ids):
                r.append_token(token, now)
                if logprobs is not None:
                    r.pending_logprobs.append(logprobs[i])
                self.num_generation_tokens += 1
                if r.grammar is not None and (r.reasoning is None or r.reasoning.last.answer):
                    r.grammar.accept(token)
                    if r.grammar.error is not None:  # the mask allowed it, so never expected
                        r.finish(FinishReason.ABORT, error=f"grammar: {r.grammar.error}")
                        break
                r.check_stop(self.eos_token_ids, self.max_model_len)
                if r.is_finished:
                    break
            if num_drafts:
                # A stop inside the accepted run leaves later drafts' KV unkept.
                r.num_computed_tokens = min(r.num_computed_tokens, r.num_tokens)
                self.kv.cache_full_blocks(r, r.num_computed_tokens)
            if r.is_finished:
                self.remove(r)
            outputs.append(r.take_delta())
        return outputs

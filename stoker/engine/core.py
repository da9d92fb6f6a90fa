"""EngineCore: the step loop, three typed messages (stoker/engine/outputs.py):

    SchedulerOutput = scheduler.schedule()
    ModelRunnerOutput = runner.execute_model(SchedulerOutput)
    deltas = scheduler.update_from_output(SchedulerOutput, ModelRunnerOutput)

It validates requests, enforces deadlines and hands deltas back; request
progress, stop conditions and token times are the scheduler's
(update_from_output). It knows nothing of HTTP or keys.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import llguidance
import torch

from stoker.config import EngineConfig, ModelConfig
from stoker.engine.detokenizer import IncrementalDetokenizer, stop_matcher, stop_matcher_ready
from stoker.engine.devices import resolve_device, resolve_dtype, resolve_kv_dtype
from stoker.engine.grammar_compiler import GrammarCompiler
from stoker.engine.kv_block_bytes import KVBlockBytes
from stoker.engine.kv_cache import NULL_BLOCK_ID, KVCacheManager
from stoker.engine.kv_disk import DiskBlockStore, DiskLayout, DiskTierStats, block_file_bytes
from stoker.engine.kv_disk_tier import DiskTier
from stoker.engine.kv_events import KVEventLog, KVEventPublisher
from stoker.engine.kv_sizing import size_kv_cache, total_memory_bytes
from stoker.engine.kv_transfer_fetch import PeerFetch
from stoker.engine.kv_transfer_rooms import KVSender, Rooms
from stoker.engine.kv_transfer_server import KVTransferServer
from stoker.engine.lora_registry import LoraRegistry
from stoker.engine.outputs import ScheduledRequest, SchedulerOutput
from stoker.engine.params import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineStats,
    FinishReason,
    LoraAnswer,
    LoraCommand,
    SamplingParams,
)
from stoker.engine.pins import PrefixAnswer, PrefixCommand, PrefixPins
from stoker.engine.reasoning import SequenceReasoning
from stoker.engine.request import Request
from stoker.engine.runner import ModelRunner, kv_bytes_per_block
from stoker.engine.sampler import SampleRow, prepare
from stoker.engine.scheduler import Scheduler
from stoker.engine.spec import Proposer
from stoker.engine.spec.draft import DraftProposer
from stoker.engine.spec.ngram import NgramProposer
from stoker.engine.spec.policy import SpeculationPolicy, row_costs
from stoker.engine.spec.speculator import Speculator
from stoker.engine.structured import SequenceGrammar
from stoker.models.digest import model_digest
from stoker.models.loader import load_model, weights_stay_quantized
from stoker.models.quant.weights import GGMLTensor, describe, quant_isa
from stoker.models.registry import build_model
from stoker.models.tokenizer import Tokenizer

log = logging.getLogger("stoker.engine")

PREPARE_POLL_S = 0.01
"""How long an otherwise idle step waits for the worker preparing requests."""


@dataclass
class _Preparing:
    """A request whose grammar or stop list the worker is building."""

    request: EngineCoreRequest
    prompt: list[int]
    max_tokens: int
    seeds: list[int]
    ready: Future[llguidance.LLMatcher | None]


class EngineCore:
    def __init__(self, config: EngineConfig | None = None) -> None:
        # model_validate rather than EngineConfig(): mypy, without pydantic's plugin, wants every field.
        self.config = config = config or EngineConfig.model_validate({})
        started = time.perf_counter()
        # Bound before the weights load: an endpoint in use fails the start at once, in one line.
        self.kv_events: KVEventPublisher | None = None
        if config.kv_events_endpoint and config.enable_prefix_caching:
            self.kv_events = KVEventPublisher(
                config.kv_events_endpoint,
                config.kv_events_topic,
                config.kv_events_replay_endpoint,
                config.kv_events_buffer_steps,
            )
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        model_path = config.resolved_model_path()
        digest: Future[str] | None = None
        if config.kv_cache_disk or config.kv_role != "both":
            # The disk tier's folder and the KV transfer's layout are keyed by the weights' digest:
            # hashed while they load (hashlib releases the GIL), not after.
            digesting = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stoker-digest")
            digest = digesting.submit(model_digest, model_path, reuse=True)
            digesting.shutdown(wait=False)
        quantized_weights = weights_stay_quantized(model_path, str(self.device), config.quantization)
        self.dtype = resolve_dtype(config.dtype, self.device, quantized_weights)
        kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype, quantized_weights)
        loaded = load_model(model_path, self.dtype, str(self.device), config.quantization)
        quantized = any(isinstance(w, GGMLTensor) for w in loaded.weights.values())
        self.weights_summary = describe(loaded.weights)
        self.quantized_matmul = quant_isa() if quantized else "none"
        log.info("weights: %s; quantized matmul: %s", self.weights_summary, self.quantized_matmul)
        self.model_config: ModelConfig = loaded.config
        self.tokenizer: Tokenizer = loaded.tokenizer
        self.served_model_name = config.served_model_name or loaded.config.name
        self.eos_token_ids = frozenset(loaded.config.eos_token_ids)
        self.max_model_len = min(
            config.max_model_len or loaded.config.max_position_embeddings,
            loaded.config.max_position_embeddings,
        )
        if config.max_model_len and config.max_model_len > self.max_model_len:
            log.warning(
                "max_model_len %d is beyond the %d positions the model was trained for: serving %d",
                config.max_model_len,
                self.max_model_len,
                self.max_model_len,
            )
        model = build_model(loaded.config, loaded.weights, self.dtype, self.device, self.max_model_len)
        del loaded

        block_size = config.block_size
        per_block = kv_bytes_per_block(self.model_config, block_size, kv_dtype)
        kv_size = size_kv_cache(config, per_block, self.max_model_len, total_memory_bytes(self.device))
        num_blocks = kv_size.num_blocks
        kv_log: KVEventLog | None = None
        if self.kv_events is not None:
            kv_log = KVEventLog(block_size, config.kv_events_include_token_ids)
            kv_log.cleared()  # a new engine starts empty: subscribers drop what a previous one held
        self.kv = KVCacheManager(num_blocks, block_size, config.enable_prefix_caching, kv_log)
        self.runner = ModelRunner(model, num_blocks, block_size, kv_dtype)
        self.disk: DiskTier | None = None
        if config.kv_cache_disk:
            assert digest is not None
            self.disk = self._disk_tier(config, digest.result(), kv_dtype, per_block, kv_log)
        self.kv_layout: DiskLayout | None = None
        """What a peer's KV blocks must match (kv_role prefill or decode); None on both."""
        self.kv_rooms: Rooms | None = None
        self.kv_sender: KVSender | None = None
        self.kv_server: KVTransferServer | None = None
        self.kv_peers: PeerFetch | None = None
        if config.kv_role != "both":
            assert digest is not None
            self.kv_layout = DiskLayout(digest.result(), str(kv_dtype).removeprefix("torch."), block_size, per_block)
            self._kv_transfer(config, self.kv_layout)
        self.pins = PrefixPins(self.disk.store if self.disk is not None else None, block_size)
        self.speculator: Speculator | None = None
        if config.speculative_method != "none" and config.num_speculative_tokens > 0:
            policy = SpeculationPolicy(
                config.speculative_method, config.num_speculative_tokens, config.speculative_max_batch
            )
            self.speculator = Speculator(self._proposer(config), policy)
        self.loras = LoraRegistry(self.model_config, config.max_lora_rank, config.max_loaded_loras)
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            config.scheduling_policy,
            self.eos_token_ids,
            self.max_model_len,
            self.speculator,
            self.disk,
            self.loras,
            config.max_loras,
            self.kv_peers,
            self.kv_sender,
        )
        self.seed_stream = random.Random(config.seed)
        self.requests: dict[str, list[Request]] = {}
        self.num_steps = 0
        self.busy_seconds = 0.0
        self.last_step_tokens = 0
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        self.num_constrained_requests = 0
        self._preparing: dict[str, _Preparing] = {}
        """Requests waiting for the worker (a grammar to compile, a long stop
        list), in arrival order; not in the scheduler yet."""
        self._workers: ThreadPoolExecutor | None = None
        self._rejections: list[tuple[str, str]] = []
        self.load_seconds = time.perf_counter() - started
        log.info(
            "engine ready: %s (%s, %s) on %s, KV cache %s %d blocks x %d tokens = %d tokens (%.1f MiB, by %s), "
            "loaded in %.1fs",
            self.served_model_name,
            self.model_config.architecture,
            str(self.dtype).removeprefix("torch."),
            self.device,
            str(kv_dtype).removeprefix("torch."),
            self.kv.num_blocks,
            block_size,
            self.kv_capacity_tokens,
            self.kv.num_blocks * per_block / 2**20,
            kv_size.rule,
            self.load_seconds,
        )

    def _disk_tier(
        self, config: EngineConfig, digest: str, kv_dtype: torch.dtype, block_bytes: int, kv_log: KVEventLog | None
    ) -> DiskTier:
        """The prefix cache's disk tier, its folder keyed by what makes a block's bytes valid."""
        assert config.kv_cache_disk is not None and config.kv_cache_disk_size is not None
        started = time.perf_counter()
        layout = DiskLayout(
            digest,
            str(kv_dtype).removeprefix("torch."),
            config.block_size,
            block_bytes,
        )
        file_bytes = block_file_bytes(layout)
        if config.kv_cache_disk_size < file_bytes:
            raise ValueError(
                f"--kv-cache-disk-size {config.kv_cache_disk_size} is below one KV block of this model "
                f"({file_bytes} bytes)"
            )
        store = DiskBlockStore(Path(config.kv_cache_disk), config.kv_cache_disk_size, layout)
        stats = store.stats()
        log.info(
            "KV disk tier: %s, %.1f of %.1f MiB used (%d blocks of %.2f MiB), opened in %.1fs",
            store.root,
            stats.bytes_used / 2**20,
            config.kv_cache_disk_size / 2**20,
            stats.bytes_used // file_bytes,
            file_bytes / 2**20,
            time.perf_counter() - started,
        )
        return DiskTier(store, self.runner.kv_caches, self.kv.pool, config.block_size, kv_log)

    def _kv_transfer(self, config: EngineConfig, layout: DiskLayout) -> None:
        """A prefill worker's rooms and KV transfer server, or a decode worker's pulls (docs/disaggregation.md)."""
        block_bytes = KVBlockBytes(self.runner.kv_caches)
        if config.kv_role == "prefill":
            self.kv_rooms = Rooms(config.kv_transfer_timeout)
            self.kv_sender = KVSender(self.kv_rooms, self.kv)
            self.kv_server = KVTransferServer(
                config.kv_transfer_host,
                config.kv_transfer_port,
                layout,
                self.kv_rooms,
                block_bytes,
                config.kv_transfer_timeout,
            )
            log.info(
                "prefill worker: KV transfer server on %s:%d (KV %s, %d-token blocks of %d bytes)",
                config.kv_transfer_host,
                self.kv_server.port,
                layout.kv_dtype,
                layout.block_size,
                layout.block_bytes,
            )
        else:
            self.kv_peers = PeerFetch(layout, block_bytes, self.kv.pool, layout.block_size, config.kv_transfer_timeout)
            log.info("decode worker: prompts' KV blocks pulled from prefill workers (KV %s)", layout.kv_dtype)

    def housekeep(self) -> None:
        """Between steps, also while idle: release the prefill rooms that were pulled, abandoned or expired,
        and the blocks of a decode worker's pulls that stopped after their request left."""
        if self.kv_sender is not None:
            self.kv_sender.settle()
        if self.kv_peers is not None:
            self.kv_peers.reap()

    def close(self) -> None:
        """Write the disk tier's queued blocks and stop its threads (a graceful shutdown)."""
        if self.disk is not None:
            self.disk.close()
        if self.kv_server is not None:
            self.kv_server.close()
        if self.kv_peers is not None:
            self.kv_peers.close()
        self.loras.close()

    def measure_row_costs(self) -> None:
        """auto chooses draft lengths from what steps of 1 .. k + 1 rows cost on
        this machine: measured once (a few hundred ms on the default model), on
        throwaway rows written into the null block. Not part of construction:
        the engine process measures once it has been idle for a poll interval
        after it reported ready (a quarter of a second less to /ready, and
        the front end done starting; until then auto drafts about the
        expected accepted run), LLM right after it builds its engine."""
        spec = self.speculator
        if spec is None or not spec.policy.adaptive:
            return
        bs = self.kv.block_size
        greedy = SampleRow(SamplingParams(temperature=0.0), [], [], None, [])

        def run(rows: int) -> None:
            table = [NULL_BLOCK_ID] * -(-rows // bs)
            step = ScheduledRequest(("__row_costs__", 0), [0] * rows, 0, table, greedy, num_draft_tokens=rows - 1)
            self.runner.execute(SchedulerOutput([step]))

        spec.policy.costs = row_costs(run, spec.policy.num_tokens + 1)
        log.info(
            "speculative decoding: step ms by rows 1..%d: %s",
            len(spec.policy.costs),
            " ".join(f"{c * 1000:.1f}" for c in spec.policy.costs),
        )

    def _proposer(self, config: EngineConfig) -> Proposer:
        """The draft model when one is given (method draft, or auto), else prompt lookup."""
        if config.speculative_model and config.speculative_method in ("draft", "auto"):
            proposer = DraftProposer.load(
                config.speculative_model,
                config.quantization,
                self.device,
                self.model_config.vocab_size,
                self.kv_capacity_tokens,
                self.kv.block_size,
            )
            log.info("speculative decoding: draft model %s", config.speculative_model)
            return proposer
        log.info(
            "speculative decoding: %s (n-grams %d..%d, up to %d tokens)",
            config.speculative_method,
            config.speculative_ngram_min,
            config.speculative_ngram_max,
            config.num_speculative_tokens,
        )
        return NgramProposer(config.speculative_ngram_min, config.speculative_ngram_max)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv.num_blocks * self.kv.block_size

    @property
    def grammars(self) -> GrammarCompiler:
        """Built on the first constrained request (wrapping the tokenizer takes
        ~0.4 s, which servers that never constrain should not pay at start)."""
        with self._grammars_lock:  # the worker thread builds it; stats() only reads it
            if self._grammars is None:
                self._grammars = GrammarCompiler(
                    self.tokenizer.hf, self.model_config.vocab_size, sorted(self.eos_token_ids) or None
                )
            return self._grammars

    # ----------------------------------------------------------- requests

    def add_request(self, req: EngineCoreRequest) -> None:
        """Validate and enqueue. Raises ValueError (naming the field) and changes nothing if invalid."""
        params = req.sampling_params
        params.validate()
        if req.request_id in self.requests or req.request_id in self._preparing:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        prompt = list(req.prompt_token_ids)
        if not prompt:
            raise ValueError("prompt must not be empty")
        if req.lora_name is not None and not self.loras.is_registered(req.lora_name):
            raise ValueError(f"LoRA adapter {req.lora_name!r} is not registered on this engine")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        room = self.max_model_len - len(prompt)
        if room < 1:
            raise ValueError(
                f"prompt is {len(prompt)} tokens; this model's context is {self.max_model_len} "
                "and at least one token must be generated"
            )
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"max_tokens is {params.max_tokens} but the prompt is {len(prompt)} tokens and the "
                f"context is {self.max_model_len}: at most {room} can be generated"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        blocks = -(-(len(prompt) + max_tokens) // self.kv.block_size)
        if blocks > self.kv.num_blocks:
            raise ValueError(
                f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) need {blocks} KV blocks; "
                f"the cache has {self.kv.num_blocks}"
            )
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be below the vocabulary size {vocab}")
        if params.logit_bias and any(t >= vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be below the vocabulary size {vocab}")
        if params.reasoning is not None and any(
            t >= vocab for t in params.reasoning.end_token_ids + params.reasoning.start_token_ids
        ):
            raise ValueError(f"reasoning marker token ids must be below the vocabulary size {vocab}")
        self._check_kv_transfer(req)
        # Each sample samples from its own generator, so its tokens never depend on
        # the batch: seeded by the request's seed (+ index), else by the next draw
        # of a stream started from EngineConfig.seed (--seed), so the same requests
        # in the same order on a server with the same --seed give the same text.
        # Drawn now, in arrival order, even for a request that waits for its grammar.
        seeds = [
            params.seed + index if params.seed is not None else self.seed_stream.getrandbits(63)
            for index in range(params.n)
        ]
        grammar = self._grammars.cached(params.grammar) if params.grammar and self._grammars else None
        if (params.grammar is None or grammar is not None) and stop_matcher_ready(params.stop):
            self._admit(req, prompt, max_tokens, seeds, grammar)
            return
        # A grammar to compile or a long stop list to build: in the worker, never on the
        # step loop; the request waits (outside the scheduler) until it is ready.
        if self._workers is None:
            self._workers = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stoker-prepare")
        ready = self._workers.submit(self._build, params)
        self._preparing[req.request_id] = _Preparing(req, prompt, max_tokens, seeds, ready)

    def _check_kv_transfer(self, req: EngineCoreRequest) -> None:
        split = req.kv_transfer
        if split is None:
            return
        if not 0 <= split.room < 2**64:
            raise ValueError(f"bootstrap_room must be in [0, 2^64), got {split.room}")
        if split.send and self.kv_rooms is None:
            raise ValueError("this engine is no prefill worker (kv_role prefill): it parks no KV blocks")
        if not split.send and self.kv_peers is None:
            raise ValueError("this engine is no decode worker (kv_role decode): it pulls no KV blocks")
        if split.send and self.kv_rooms is not None and self.kv_rooms.num_blocks(split.room) is not None:
            raise ValueError(f"bootstrap_room {split.room} is already in use on this prefill worker")

    def _build(self, params: SamplingParams) -> llguidance.LLMatcher | None:
        """In the worker thread: what a request needs that takes long to build."""
        if params.stop:
            stop_matcher(tuple(params.stop))
        if params.grammar is None:
            return None
        return self.grammars.compile(params.grammar)  # drops the GIL while it compiles

    def _admit(
        self,
        req: EngineCoreRequest,
        prompt: list[int],
        max_tokens: int,
        seeds: list[int],
        grammar: llguidance.LLMatcher | None,
    ) -> None:
        """Samples into the scheduler, with everything each step needs built now."""
        params = req.sampling_params
        vocab = self.model_config.vocab_size
        prepared = prepare(params, self.eos_token_ids, self.device)
        samples = []
        for index, seed in enumerate(seeds):
            r = Request(
                req.request_id,
                index,
                prompt,
                params,
                req.arrival_time,
                req.priority,
                req.deadline,
                max_tokens,
                torch.Generator().manual_seed(seed),
                prepared,
                req.lora_name,
            )
            r.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt, params)
            if params.reasoning is not None:
                r.reasoning = SequenceReasoning(params, params.reasoning, self.tokenizer, prompt, vocab)
            if grammar is not None:
                r.grammar = SequenceGrammar(grammar.deep_copy(), vocab, self.tokenizer.eos_token_id)
            samples.append(r)
        if req.kv_transfer is not None:
            samples[0].kv_transfer = req.kv_transfer  # the others share its prompt through the prefix cache
            if req.kv_transfer.send and self.kv_sender is not None:
                self.kv_sender.add(samples[0], req.kv_transfer.room)
        if grammar is not None:
            self.num_constrained_requests += 1
        self.requests[req.request_id] = samples
        for r in samples:
            self.scheduler.add(r)

    def _admit_prepared(self) -> None:
        """Requests whose grammar (or stop list) the worker has finished: into the
        scheduler, in arrival order; a grammar that failed is a rejection."""
        for request_id, waiting in list(self._preparing.items()):
            if not waiting.ready.done():
                continue
            del self._preparing[request_id]
            try:
                grammar = waiting.ready.result()
            except ValueError as exc:  # GrammarError: what add_request used to raise
                self._rejections.append((request_id, f"grammar: {exc}"))
                continue
            try:
                self._admit(waiting.request, waiting.prompt, waiting.max_tokens, waiting.seeds, grammar)
            except ValueError as exc:  # its bootstrap_room taken meanwhile
                self._rejections.append((request_id, str(exc)))

    def take_rejections(self) -> list[tuple[str, str]]:
        """(request_id, message) of requests refused after add_request returned
        (their grammar failed to compile in the worker); each is reported once."""
        rejected, self._rejections = self._rejections, []
        return rejected

    def _abort_preparing(self, request_id: str, error: str | None) -> list[EngineCoreOutput]:
        waiting = self._preparing.pop(request_id, None)
        if waiting is None:
            return []
        req = waiting.request
        outputs = []
        for index in range(req.sampling_params.n):
            r = Request(req.request_id, index, waiting.prompt, req.sampling_params, req.arrival_time)
            r.finish(FinishReason.ABORT, error=error)
            outputs.append(r.take_delta())
        return outputs

    def abort_requests(self, request_ids: list[str], error: str | None = None) -> list[EngineCoreOutput]:
        outputs = []
        for request_id in request_ids:
            outputs.extend(self._abort_preparing(request_id, error))
            for r in self.requests.get(request_id, []):
                if not r.is_finished:
                    outputs.append(self.scheduler.abort(r, error))
            self._forget_if_done(request_id)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._preparing)

    # ---------------------------------------------------------------- step

    def step(self) -> list[EngineCoreOutput]:
        self.housekeep()
        outputs = self._expire_deadlines()
        if self._preparing:
            self._admit_prepared()
        if self.loras.pending:
            outputs += self._collect_lora_loads()
        scheduled = self.scheduler.schedule()
        self.last_step_tokens = scheduled.num_tokens
        if not scheduled.scheduled:
            if self._preparing:
                # Nothing else to run: wait a little for the worker rather than spin
                # (the process loop comes back to read its input between waits).
                wait([w.ready for w in self._preparing.values()], PREPARE_POLL_S, FIRST_COMPLETED)
            elif self.loras.busy:
                self.loras.wait(PREPARE_POLL_S)  # a request waits for its adapter's load
            elif self.kv_peers is not None and self.kv_peers.loading:
                self.kv_peers.wait(PREPARE_POLL_S)  # a request waits for its blocks from its prefill worker
            elif self.disk is not None:
                self.disk.wait(PREPARE_POLL_S)  # a request waits for its blocks from disk
            return outputs
        self.num_steps += 1
        started = time.perf_counter()
        result = self.runner.execute_model(scheduled)
        deltas = self.scheduler.update_from_output(scheduled, result)
        if self.kv_sender is not None:
            self.kv_sender.collect()  # the blocks this step computed go out while the prompt's next chunk runs
        for delta in deltas:
            if delta.finished:
                self._forget_if_done(delta.request_id)
        if self.kv_events is not None:
            self.publish_kv_events()
        self.busy_seconds += time.perf_counter() - started
        return self.pins.settle(outputs + deltas)

    # ---------------------------------------------------------------- LoRA

    def lora_command(self, command: LoraCommand) -> list[EngineCoreOutput]:
        """Register an adapter (answered by take_lora_answers once its load is done) or remove one:
        requests still naming it end with an error (the caller drains them first)."""
        if command.action == "add":
            self.loras.register(command.ticket, command.name, command.path)
            return []
        outputs = self._abort_adapter(command.name, f"LoRA adapter {command.name!r} was unloaded")
        self.loras.remove(command.name)
        self.loras.answer(LoraAnswer(command.ticket))
        return outputs

    def take_lora_answers(self) -> list[LoraAnswer]:
        if self.loras.busy:
            self.loras.poll(self.scheduler.loras_in_use())
        return self.loras.take_answers()

    def loras_loading(self) -> bool:
        return self.loras.busy

    def _collect_lora_loads(self) -> list[EngineCoreOutput]:
        """Finished loads into memory; requests waiting for one that failed end with its error."""
        self.loras.poll(self.scheduler.loras_in_use())
        outputs = []
        for name, message in self.loras.take_failures():
            outputs += self._abort_adapter(name, message, waiting_only=True)
        return outputs

    def _abort_adapter(self, name: str, error: str, waiting_only: bool = False) -> list[EngineCoreOutput]:
        named = {
            r.request_id
            for samples in self.requests.values()
            for r in samples
            if r.lora_name == name and not (waiting_only and r in self.scheduler.running)
        }
        if not waiting_only:
            named |= {rid for rid, w in self._preparing.items() if w.request.lora_name == name}
        return self.abort_requests(sorted(named), error)

    def _expire_deadlines(self) -> list[EngineCoreOutput]:
        now = time.time()
        outputs = []
        for request_id, waiting in list(self._preparing.items()):
            deadline = waiting.request.deadline
            if deadline is not None and now > deadline:
                outputs.extend(self._abort_preparing(request_id, "deadline"))
        for samples in list(self.requests.values()):
            for r in samples:
                if r.deadline is not None and now > r.deadline and not r.is_finished:
                    outputs.extend(self.abort_requests([r.request_id], error="deadline"))
                    break
        return outputs

    def _forget_if_done(self, request_id: str) -> None:
        samples = self.requests.get(request_id)
        if samples is not None and all(r.is_finished for r in samples):
            del self.requests[request_id]

    def stats(self) -> EngineStats:
        waiting = self.scheduler.waiting
        disk = self.disk.store.stats() if self.disk is not None else DiskTierStats()
        spec = self.speculator
        lora_running, lora_waiting = self.scheduler.lora_counts()
        server, rooms, peers = self.kv_server, self.kv_rooms, self.kv_peers
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(waiting) + sum(w.request.sampling_params.n for w in self._preparing.values()),
            num_waiting_tokens=sum(r.num_tokens - r.num_computed_tokens for r in waiting),
            kv_blocks_total=self.kv.num_blocks,
            kv_blocks_used=self.kv.num_used_blocks,
            block_size=self.kv.block_size,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            prompt_tokens=self.scheduler.num_prompt_tokens,
            generation_tokens=self.scheduler.num_generation_tokens,
            steps=self.num_steps,
            busy_seconds=self.busy_seconds,
            last_step_tokens=self.last_step_tokens,
            constrained_requests=self.num_constrained_requests,
            grammar_mask_steps=self.scheduler.num_mask_steps,
            grammar_mask_seconds=list(self.scheduler.mask_seconds),
            grammar_compiles=self._grammars.num_compiled if self._grammars else 0,
            grammar_compile_seconds=list(self._grammars.compile_seconds) if self._grammars else [],
            spec_drafts=spec.num_drafts if spec else 0,
            spec_draft_tokens=spec.num_draft_tokens if spec else 0,
            spec_accepted_tokens=spec.num_accepted_tokens if spec else 0,
            spec_accepted_per_position=list(spec.accepted_per_position) if spec else [],
            kv_events_published=self.kv_events.num_published if self.kv_events else 0,
            kv_events_dropped=self.kv_events.num_dropped if self.kv_events else 0,
            kv_disk_hits=disk.hits,
            kv_disk_misses=disk.misses,
            kv_disk_bytes_read=disk.bytes_read,
            kv_disk_bytes_written=disk.bytes_written,
            kv_disk_pending_writes=disk.pending_writes,
            kv_disk_writes_dropped=disk.writes_dropped,
            kv_disk_evictions=disk.evictions,
            kv_disk_corrupt_dropped=disk.corrupt_dropped,
            kv_disk_bytes_used=disk.bytes_used,
            kv_disk_degraded=disk.degraded,
            max_loras=self.config.max_loras,
            lora_running=lora_running,
            lora_waiting=lora_waiting,
            lora_registered=len(self.loras.paths),
            lora_resident=self.loras.num_resident,
            lora_resident_bytes=self.loras.resident_bytes,
            lora_loads=self.loras.num_loads,
            lora_load_failures=self.loras.num_load_failures,
            lora_evictions=self.loras.num_evictions,
            lora_load_seconds=list(self.loras.load_seconds),
            kv_transfer_blocks_sent=server.num_blocks_sent if server else 0,
            kv_transfer_bytes_sent=server.num_bytes_sent if server else 0,
            kv_transfer_rooms_parked=rooms.num_parked if rooms else 0,
            kv_transfer_rooms_expired=rooms.num_expired if rooms else 0,
            kv_transfer_blocks_received=peers.num_blocks_received if peers else 0,
            kv_transfer_bytes_received=peers.num_bytes_received if peers else 0,
            kv_transfer_blocks_skipped=peers.num_blocks_skipped if peers else 0,
            kv_transfer_pulls=peers.num_pulls if peers else 0,
            kv_transfer_pull_seconds=peers.pull_seconds if peers else 0.0,
            kv_transfer_pulls_failed=peers.num_failed if peers else 0,
            kv_transfer_pulls_timed_out=peers.num_timed_out if peers else 0,
        )

    def prefix_command(self, command: PrefixCommand) -> None:
        """Pin, unpin or list pinned prefixes; the answer comes from take_prefix_answers,
        a pin's once its prefix is computed (a prompt-only request, scheduled as any other)."""
        request = self.pins.handle(command)
        if request is not None:
            try:
                self.add_request(request)
            except ValueError as exc:
                self.pins.refused(request, str(exc))

    def take_prefix_answers(self) -> list[PrefixAnswer]:
        return self.pins.take_answers()

    def reset_prefix_cache(self) -> int:
        """Drop the prefix cache's unused blocks (those no request holds); returns how many."""
        dropped = self.kv.reset_prefix_cache()
        if self.kv_events is not None:
            self.publish_kv_events()
        return dropped

    def publish_kv_events(self) -> None:
        """One batch for what the cache changed since the last one (once per step)."""
        assert self.kv_events is not None and self.kv.pool.events is not None
        if self.disk is not None:
            self.disk.record_events()
        events = self.kv.pool.events.take()
        if events:
            self.kv_events.publish(events)

"""Typed messages that cross the engine's boundary: what a caller asks for
(SamplingParams, EngineCoreRequest) and what the engine hands back
(EngineCoreOutput deltas, accumulated into RequestOutput by the caller)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal


class FinishReason(str, Enum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the caller, a deadline, or a drain


@dataclass(frozen=True)
class ReasoningParams:
    """A thinking model's reply: thinking first, then the answer, kept apart
    (stoker/engine/reasoning.py runs the phases). The server builds it from the
    model's markers; with it, EngineCoreOutput.new_text carries the answer alone."""

    end_token_ids: tuple[int, ...]
    """The marker that ends the thinking ("</think>"); non-empty."""
    start_token_ids: tuple[int, ...] = ()
    """The marker that opens it ("<think>"): output that starts with it thinks;
    empty, or output that starts otherwise, answers with no thinking."""
    thinking_open: bool = False
    """The prompt already opened the thinking (a template that ends with
    "<think>"): the first output token thinks."""
    budget: int | None = None
    """Most thinking tokens (the start marker not counted); once spent the
    engine writes end_token_ids itself and the answer follows. 0: no thinking
    (the end marker comes first). None: unbounded but for max_tokens."""

    def __post_init__(self) -> None:
        # msgspec decodes tuples as given; lists from other callers become tuples.
        object.__setattr__(self, "end_token_ids", tuple(self.end_token_ids))
        object.__setattr__(self, "start_token_ids", tuple(self.start_token_ids))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field (token ids against the
        vocabulary are checked by the engine, which knows its size)."""

        def token_ids(value: tuple[int, ...]) -> bool:
            return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)

        if not self.end_token_ids or not token_ids(self.end_token_ids):
            raise ValueError(f"reasoning.end_token_ids must be non-empty token ids, got {self.end_token_ids!r}")
        if not token_ids(self.start_token_ids):
            raise ValueError(f"reasoning.start_token_ids must be token ids, got {self.start_token_ids!r}")
        if not isinstance(self.thinking_open, bool):
            raise ValueError(f"reasoning.thinking_open must be a boolean, got {self.thinking_open!r}")
        if self.budget is not None and (
            isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 0
        ):
            raise ValueError(f"reasoning.budget must be a non-negative integer, got {self.budget!r}")


@dataclass
class SamplingParams:
    """How to sample one prompt. Field names and meanings follow vLLM/OpenAI."""

    n: int = 1
    """Number of independent samples of the prompt; they share its KV blocks."""
    max_tokens: int | None = 16
    """Upper bound on generated tokens; None means "up to the model's context";
    0 only processes the prompt (with prompt_logprobs: score it)."""
    min_tokens: int = 0
    """eos and stop token ids are suppressed until this many tokens exist."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1 disables top-k."""
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    """>1 discourages tokens seen in prompt or output (CTRL-style, as HF/vLLM)."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    """Same seed and prompt give the same text whatever else is in the batch."""
    stop: list[str] = field(default_factory=list)
    """Strings that end generation; they are not included in the output text."""
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    """None: no logprobs. k >= 0: the chosen token's logprob plus the top k alternatives."""
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    """Added to these token ids' logits before anything else (OpenAI's logit_bias,
    each in [-100, 100]: -100 all but bans a token, 100 all but forces it)."""
    prompt_logprobs: int | None = None
    """None: none. k >= 0: each prompt token's logprob plus the top k alternatives
    (the first token's entry is None). Such a prompt is always computed in full,
    never served from the prefix cache."""
    grammar: str | None = None
    """An llguidance grammar the output must match (stoker/engine/grammars.py
    builds it from a JSON schema, regex, choice list or Lark/GBNF grammar);
    the sequence stops (finish_reason "stop") when the grammar is complete."""
    num_speculative_tokens: int | None = None
    """Most draft tokens verified per step for this request: None follows the
    engine (--num-speculative-tokens, adaptive); 0 turns speculation off for it.
    Output is the same either way (verification is exact); only speed changes."""
    reasoning: ReasoningParams | None = None
    """A thinking model's markers and budget: thinking and answer come apart
    (new_reasoning_text, new_text), the grammar and stop strings apply to the
    answer only, and a spent budget ends the thinking. None: all output is answer."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""

        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        def finite(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                bad(name, "must be a finite number")
            return float(value)

        def integer(name: str) -> int:
            value: int = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                bad(name, "must be an integer")
            return value

        if integer("n") < 1:
            bad("n", "must be at least 1")
        if self.max_tokens is not None and integer("max_tokens") < 0:
            bad("max_tokens", "must be non-negative")
        if integer("min_tokens") < 0:
            bad("min_tokens", "must be non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        if finite("temperature") < 0:
            bad("temperature", "must be non-negative")
        if not 0.0 < finite("top_p") <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if integer("top_k") < -1:
            bad("top_k", "must be -1, 0 (disabled) or positive")
        if not 0.0 <= finite("min_p") <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if finite("repetition_penalty") <= 0:
            bad("repetition_penalty", "must be positive")
        if not -2.0 <= finite("presence_penalty") <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= finite("frequency_penalty") <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.seed is not None and not -(2**63) <= integer("seed") < 2**63:
            bad("seed", "must be a 64-bit signed integer")
        if self.num_speculative_tokens is not None and not 0 <= integer("num_speculative_tokens") <= 16:
            bad("num_speculative_tokens", "must be in [0, 16]")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a non-empty string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            bad("stop_token_ids", "must be a list of non-negative integers")
        if self.logit_bias is not None and not (
            isinstance(self.logit_bias, dict)
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.logit_bias)
            and all(
                isinstance(b, (int, float)) and not isinstance(b, bool) and -100.0 <= b <= 100.0
                for b in self.logit_bias.values()
            )
        ):
            bad("logit_bias", "must map non-negative token ids to biases in [-100, 100]")
        if self.logprobs is not None and not 0 <= integer("logprobs") <= 20:
            bad("logprobs", "must be between 0 and 20")
        if self.prompt_logprobs is not None and not 0 <= integer("prompt_logprobs") <= 20:
            bad("prompt_logprobs", "must be between 0 and 20")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            bad("grammar", "must be a non-empty grammar string")
        if self.reasoning is not None:
            if not isinstance(self.reasoning, ReasoningParams):
                bad("reasoning", "must be ReasoningParams")
            self.reasoning.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class KVTransferParams:
    """Pairs the two halves of one request split by a PD router (sglang-router's bootstrap fields)."""

    room: int
    """bootstrap_room: the same number on the prefill worker's request and the decode worker's."""
    send: bool
    """True on a prefill worker: run the prompt and park its blocks for a peer. False on a decode
    worker: pull the prompt's blocks from peer_host:peer_port before computing what is left."""
    peer_host: str = ""
    """The prefill worker's KV transfer server (its host); used when send is False."""
    peer_port: int = 0
    """The prefill worker's KV transfer server (its port); used when send is False."""


@dataclass
class EngineCoreRequest:
    """One prompt submitted to the engine. n > 1 fans out inside the engine."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    """time.time() when the request reached stoker; queue time is measured from it."""
    priority: int = 0
    """Lower value is served first (as vLLM). 0 interactive, 1 batch by convention."""
    deadline: float | None = None
    """time.time() after which the request is dropped (waiting) or aborted (running)."""
    lora_name: str | None = None
    """The registered LoRA adapter applied to this request (AsyncEngineClient.add_lora); None: the base model."""
    kv_transfer: KVTransferParams | None = None
    """Set when a PD router split this request (stoker/engine/kv_transfer.py); None: served whole here."""


@dataclass(frozen=True)
class LoraInfo:
    """A LoRA adapter the engine has loaded, validated and registered."""

    name: str
    path: str
    rank: int
    target_modules: tuple[str, ...]
    """The projections it changes (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), sorted."""
    nbytes: int
    """Bytes its tensors take in memory while it is resident."""


@dataclass(frozen=True)
class LoraCommand:
    """The front end's request to register (add) or forget (remove) an adapter; the ticket pairs the answer."""

    ticket: int
    action: Literal["add", "remove"]
    name: str
    path: str = ""


@dataclass(frozen=True)
class LoraAnswer:
    ticket: int
    info: LoraInfo | None = None
    """The adapter registered (add), None for a remove or a refusal."""
    error: str | None = None
    """Why an add was refused: one line naming the adapter (LoraError's message)."""


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    """The top-k alternatives as (token_id, logprob), best first."""
    rank: int | None = None
    """1 + the number of tokens more likely than token_id (prompt logprobs set it)."""


@dataclass
class RequestTimes:
    """Engine-stamped event times (time.time()); intervals are computed by consumers."""

    arrival: float
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)


@dataclass
class EngineCoreOutput:
    """What one step produced for one sample of one request: a delta."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob] | None
    num_prompt_tokens: int
    num_cached_tokens: int
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the sample, if any."""
    error: str | None = None
    """Set when the engine rejects or fails the request (finish_reason is ABORT)."""
    times: RequestTimes | None = None
    """Attached when the sample finishes."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """With SamplingParams.prompt_logprobs, once, on the first delta that has a token."""
    num_draft_tokens: int = 0
    """On the finishing delta: speculative tokens verified for this sample."""
    num_accepted_draft_tokens: int = 0
    """On the finishing delta: how many of them were accepted."""
    new_reasoning_text: str = ""
    """With SamplingParams.reasoning: the thinking text of this delta, markers
    left out (new_text is then the answer's text alone)."""
    num_reasoning_tokens: int = 0
    """With SamplingParams.reasoning, on every delta: this sample's thinking
    tokens so far, markers included (usage's reasoning_tokens)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    times: RequestTimes | None = None
    num_draft_tokens: int = 0
    """Speculative tokens verified for this sample (set when it finishes)."""
    num_accepted_draft_tokens: int = 0
    reasoning_text: str = ""
    """With SamplingParams.reasoning: the thinking, markers left out (text is the answer)."""
    num_reasoning_tokens: int = 0
    """With SamplingParams.reasoning: thinking tokens, markers included."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything generated so far for one request (all n samples)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)

    def apply(self, delta: EngineCoreOutput) -> CompletionOutput:
        """Fold one engine delta into this output; returns the sample it touched."""
        out = self.outputs[delta.index]
        out.token_ids.extend(delta.new_token_ids)
        out.text += delta.new_text
        out.reasoning_text += delta.new_reasoning_text
        out.num_reasoning_tokens = max(out.num_reasoning_tokens, delta.num_reasoning_tokens)
        if delta.new_logprobs is not None:
            if out.logprobs is None:
                out.logprobs = []
            out.logprobs.extend(delta.new_logprobs)
        if delta.finish_reason is not None:
            out.finish_reason = delta.finish_reason
            out.stop_reason = delta.stop_reason
            out.times = delta.times
            out.num_draft_tokens = delta.num_draft_tokens
            out.num_accepted_draft_tokens = delta.num_accepted_draft_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = delta.prompt_logprobs
        return out


@dataclass
class EngineStats:
    """A snapshot of the engine's load and cumulative counters, for metrics and admission."""

    num_running: int = 0
    num_waiting: int = 0
    num_waiting_tokens: int = 0
    """Prompt tokens of waiting requests not yet computed."""
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    block_size: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache (cumulative)."""
    prefix_cache_hits: int = 0
    """Prompt tokens found in the prefix cache (cumulative)."""
    prompt_tokens: int = 0
    """Prompt tokens computed (cumulative, excluding cache hits)."""
    generation_tokens: int = 0
    """Tokens sampled (cumulative)."""
    steps: int = 0
    busy_seconds: float = 0.0
    """Seconds spent running steps (cumulative): what a model's share of the machine's cost follows."""
    last_step_tokens: int = 0
    """Tokens scheduled in the most recent step."""
    constrained_requests: int = 0
    """Requests with an output grammar accepted (cumulative)."""
    grammar_mask_steps: int = 0
    """Steps that computed grammar bitmasks (cumulative)."""
    grammar_mask_seconds: list[float] = field(default_factory=list)
    """Bitmask time of each of the latest such steps, oldest first."""
    grammar_compiles: int = 0
    """Grammars compiled in the engine, cache misses only (cumulative)."""
    grammar_compile_seconds: list[float] = field(default_factory=list)
    """Duration of each of the latest compiles, oldest first."""
    spec_drafts: int = 0
    """Speculative proposals verified (cumulative; vllm:spec_decode_num_drafts)."""
    spec_draft_tokens: int = 0
    """Draft tokens verified (cumulative)."""
    spec_accepted_tokens: int = 0
    """Draft tokens accepted (cumulative)."""
    spec_accepted_per_position: list[int] = field(default_factory=list)
    """Accepted drafts by position in their proposal (cumulative)."""
    kv_events_published: int = 0
    """KV event batches sent on --kv-events-endpoint (cumulative)."""
    kv_events_dropped: int = 0
    """KV event batches dropped because the socket's queue was full (cumulative)."""
    kv_disk_hits: int = 0
    """Blocks read from the disk tier (--kv-cache-disk) into RAM (cumulative)."""
    kv_disk_misses: int = 0
    """Blocks looked for on the disk tier and not served: absent, or dropped as corrupt (cumulative)."""
    kv_disk_bytes_read: int = 0
    kv_disk_bytes_written: int = 0
    kv_disk_pending_writes: int = 0
    """Blocks queued for the disk tier's writer now."""
    kv_disk_writes_dropped: int = 0
    """Blocks not written: the writer's queue was full or writes were paused (cumulative)."""
    kv_disk_evictions: int = 0
    """Block files removed to stay within --kv-cache-disk-size (cumulative)."""
    kv_disk_corrupt_dropped: int = 0
    """Block files removed as truncated, corrupt or of another layout (cumulative)."""
    kv_disk_bytes_used: int = 0
    kv_disk_degraded: str | None = None
    """Why the disk tier's writes are paused (disk full, read-only, gone); None while healthy or off."""
    kv_transfer_blocks_sent: int = 0
    """KV blocks a prefill worker sent to decode workers (cumulative; --role prefill)."""
    kv_transfer_bytes_sent: int = 0
    """Bytes of those blocks on the wire, framing included (cumulative)."""
    kv_transfer_blocks_received: int = 0
    """KV blocks a decode worker received from prefill workers, verified and indexed (cumulative; --role decode)."""
    kv_transfer_bytes_received: int = 0
    """Bytes of those blocks on the wire, framing included (cumulative)."""
    kv_transfer_blocks_skipped: int = 0
    """Prompt blocks a decode worker held already (its own prefix cache), so not asked for (cumulative)."""
    kv_transfer_pulls: int = 0
    """Pulls a decode worker finished, whatever they brought (cumulative); kv_transfer_pull_seconds sums them."""
    kv_transfer_pull_seconds: float = 0.0
    """Seconds from a pull's start to its blocks indexed, summed over kv_transfer_pulls (cumulative)."""
    kv_transfer_pulls_failed: int = 0
    """Pulls that brought nothing usable: refused, unknown room, unreachable peer, a block that failed its
    checks; those tokens were computed here (cumulative)."""
    kv_transfer_pulls_timed_out: int = 0
    """Pulls given up after kv_transfer_timeout; the rest of the prompt was computed here (cumulative)."""
    kv_transfer_rooms_parked: int = 0
    """Rooms whose blocks a prefill worker holds for a decode worker now."""
    kv_transfer_rooms_expired: int = 0
    """Rooms released unpulled after kv_transfer_timeout (cumulative)."""
    max_loras: int = 0
    """LoRA adapters one step may apply (--max-loras; vllm:lora_requests_info's max_lora label)."""
    lora_running: dict[str, int] = field(default_factory=dict)
    """Running sequences by LoRA adapter (vllm:lora_requests_info's running_lora_adapters: the keys)."""
    lora_waiting: dict[str, int] = field(default_factory=dict)
    """Waiting sequences by LoRA adapter (waiting_lora_adapters), including those waiting for its load."""
    lora_registered: int = 0
    """LoRA adapters registered now."""
    lora_resident: int = 0
    """LoRA adapters in memory now (at most --max-loaded-loras)."""
    lora_resident_bytes: int = 0
    """Bytes the resident adapters' tensors take now."""
    lora_loads: int = 0
    """LoRA adapter loads from their files, registrations and reloads after eviction (cumulative)."""
    lora_load_failures: int = 0
    """LoRA loads that failed: refused registrations, and reloads of a file since changed or removed (cumulative)."""
    lora_evictions: int = 0
    """LoRA adapters dropped from memory to stay within --max-loaded-loras (cumulative)."""
    lora_load_seconds: list[float] = field(default_factory=list)
    """Duration of each of the latest adapter loads, oldest first."""

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

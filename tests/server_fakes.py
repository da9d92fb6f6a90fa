"""A deterministic stand-in for EngineCore (and its tokenizer) so the process,
client and server layers can be tested in seconds without a model.

Sample k of a request emits the letters "a", "b", "c", ... (offset by k), one
per step, each a byte token. STOKER_FAKE_STEP_S sets the time one step takes.
Queueing, priority, preemption and deadlines follow EngineCore's contract, so
control behaviour (priority order, 504 at a deadline) can be tested in seconds.
"""

from __future__ import annotations

import functools
import gc
import os
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from stoker.config import EngineConfig, ModelConfig
from stoker.engine.params import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineStats,
    FinishReason,
    RequestTimes,
    TokenLogprob,
)

OFFSET = 3  # ids 0..2 are special: 0 pad, 1 bos, 2 eos
EOS = 2


class FakeTokenizer:
    """Bytes as tokens; a ChatML-like template."""

    eos_token_ids: ClassVar[list[int]] = [EOS]
    vocab_size = 256 + OFFSET
    chat_template: str | None = None
    """No Jinja template: tools, when asked for, are listed in a system message."""

    @functools.cached_property
    def hf(self) -> Any:
        """The same byte tokens as a Hugging Face fast tokenizer: what the front
        end's grammar check wraps (the fake engine itself ignores grammars)."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {"<pad>": 0, "<s>": 1, "</s>": EOS} | {ch: b + OFFSET for b, ch in _byte_chars().items()}
        backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", bos_token="<s>", pad_token="<pad>")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [b + OFFSET for b in text.encode()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - OFFSET for i in ids if i >= OFFSET).decode(errors="replace")

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        continue_final_message: bool = False,
        variables: dict | None = None,
    ):
        """Each message as <role>content and a newline; template variables as a first <vars ...> line."""

        def content(c: object) -> str:
            return c if isinstance(c, str) else "\n".join(p["text"] for p in c)  # type: ignore[union-attr]

        text = "".join(f"<{m['role']}>{content(m.get('content') or '')}\n" for m in messages)
        if variables:
            text = "<vars " + " ".join(f"{k}={v}" for k, v in sorted(variables.items())) + ">\n" + text
        if continue_final_message:
            text = text.removesuffix("\n")
        if add_generation_prompt:
            text += "<assistant>"
        return self.encode(text) if tokenize else text


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = (b for b in range(256) if b not in printable)
    return {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(extra)}


def model_config() -> ModelConfig:
    return ModelConfig(
        architecture="FakeForCausalLM",
        vocab_size=FakeTokenizer.vocab_size,
        hidden_size=8,
        intermediate_size=16,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=8,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        eos_token_ids=[EOS],
        name="fake-model",
    )


@dataclass
class _Sample:
    index: int
    times: RequestTimes
    generated: int = 0
    done: bool = False


@dataclass
class _Req:
    request: EngineCoreRequest
    seq: int
    """Arrival order, the last tie-breaker of the queue."""
    samples: list[_Sample] = field(default_factory=list)

    def queue_key(self) -> tuple[int, float, float, int]:
        # The engine's contract: (priority, deadline, arrival); lower first.
        r = self.request
        return (r.priority, r.deadline if r.deadline is not None else float("inf"), r.arrival_time, self.seq)


class FakeEngineCore:
    """Models what the server relies on from the engine, not how it computes:
    a waiting queue ordered by (priority, deadline, arrival), at most
    max_num_seqs requests running, a better priority preempting the worst
    running request, deadlines dropping waiting requests (error="deadline")
    and aborting running ones, and the engine's timestamps."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = FakeTokenizer()
        self.model_config = model_config()
        self.max_model_len = config.max_model_len or 256
        self.block_size = config.block_size
        self.num_blocks = config.num_kv_blocks or 64
        self.step_s = float(os.environ.get("STOKER_FAKE_STEP_S", "0.01"))
        self.requests: dict[str, _Req] = {}
        self.running: list[_Req] = []
        self.seq = 0
        self.steps = 0
        self.generated = 0
        self.preemptions = 0
        self.cached_blocks = 0
        """Full prompt blocks of finished requests, as if kept in a prefix cache until a reset."""

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id}")
        if not request.prompt_token_ids:
            raise ValueError("empty prompt")
        if any(not 0 <= t < FakeTokenizer.vocab_size for t in request.prompt_token_ids):
            raise ValueError("token id out of range")
        n = request.sampling_params.n
        self.seq += 1
        self.requests[request.request_id] = _Req(
            request, self.seq, [_Sample(i, RequestTimes(arrival=request.arrival_time)) for i in range(n)]
        )

    def _out(
        self, req: _Req, sample: _Sample, ids: list[int], reason: FinishReason | None, error: str | None = None
    ) -> EngineCoreOutput:
        params = req.request.sampling_params
        logprobs = None
        if params.logprobs is not None and ids:
            logprobs = [TokenLogprob(ids[0], -0.5, [(ids[0], -0.5), (OFFSET + 32, -1.5)][: params.logprobs])]
        times = None
        if reason is not None:
            times = sample.times
            times.finished = time.time()
        return EngineCoreOutput(
            request_id=req.request.request_id,
            index=sample.index,
            new_token_ids=ids,
            new_text=self.tokenizer.decode(ids),
            new_logprobs=logprobs,
            num_prompt_tokens=len(req.request.prompt_token_ids),
            num_cached_tokens=0,
            finish_reason=reason,
            error=error,
            times=times,
        )

    def abort_requests(self, request_ids: list[str], error: str | None = None) -> list[EngineCoreOutput]:
        outputs = []
        for request_id in request_ids:
            req = self.requests.pop(request_id, None)
            if req is None:
                continue
            if req in self.running:
                self.running.remove(req)
            outputs += [self._out(req, s, [], FinishReason.ABORT, error) for s in req.samples if not s.done]
        return outputs

    def _schedule(self, now: float) -> None:
        waiting = sorted((r for r in self.requests.values() if r not in self.running), key=_Req.queue_key)
        for req in waiting:
            if len(self.running) >= self.config.max_num_seqs:
                worst = max(self.running, key=_Req.queue_key)
                if req.request.priority >= worst.request.priority:
                    break
                self.running.remove(worst)  # preempted: it waits again, keeping its tokens
                self.preemptions += 1
            self.running.append(req)
            for sample in req.samples:
                if sample.times.scheduled is None:
                    sample.times.scheduled = now

    def step(self) -> list[EngineCoreOutput]:
        time.sleep(self.step_s)
        now = time.time()
        expired = [i for i, r in self.requests.items() if r.request.deadline is not None and now > r.request.deadline]
        outputs = self.abort_requests(expired, error="deadline")
        self._schedule(now)
        self.steps += 1
        for req in list(self.running):
            params = req.request.sampling_params
            limit = params.max_tokens or self.max_model_len - len(req.request.prompt_token_ids)
            for sample in req.samples:
                if sample.done:
                    continue
                token = OFFSET + ord("a") + (sample.generated + sample.index) % 26
                if token in (params.stop_token_ids or []):  # a stop token ends the sample unseen
                    sample.done = True
                    outputs.append(self._out(req, sample, [], FinishReason.STOP))
                    continue
                sample.generated += 1
                self.generated += 1
                t = sample.times
                t.first_token = t.first_token or now
                t.last_token = now
                t.token_times.append(now)
                reason = FinishReason.LENGTH if sample.generated >= limit else None
                sample.done = reason is not None
                outputs.append(self._out(req, sample, [token], reason))
            if all(s.done for s in req.samples):
                del self.requests[req.request.request_id]
                self.running.remove(req)
                self.cached_blocks += len(req.request.prompt_token_ids) // self.block_size
        return outputs

    def reset_prefix_cache(self) -> int:
        dropped, self.cached_blocks = self.cached_blocks, 0
        return dropped

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> EngineStats:
        used = 0
        for req in self.running:
            tokens = len(req.request.prompt_token_ids) + max(s.generated for s in req.samples)
            used += -(-tokens // self.block_size)
        waiting = [r for r in self.requests.values() if r not in self.running]
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(waiting),
            num_waiting_tokens=sum(len(r.request.prompt_token_ids) for r in waiting),
            kv_blocks_total=self.num_blocks,
            kv_blocks_used=used,
            block_size=self.block_size,
            num_preemptions=self.preemptions,
            steps=self.steps,
            generation_tokens=self.generated,
        )


class SlowLoadingEngineCore(FakeEngineCore):
    """Takes STOKER_FAKE_LOAD_S seconds to load, like a big model."""

    def __init__(self, config: EngineConfig) -> None:
        time.sleep(float(os.environ.get("STOKER_FAKE_LOAD_S", "5")))
        super().__init__(config)


class CollectorCheckingEngineCore(FakeEngineCore):
    """Refuses every request after the warm-up's unless the engine loaded it with
    the garbage collector off and switched it back on once ready (stoker.engine.process)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.collected_while_loading = gc.isenabled()

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.request_id != "__warmup__" and (self.collected_while_loading or not gc.isenabled()):
            raise ValueError(f"collector on while loading: {self.collected_while_loading}, now: {gc.isenabled()}")
        super().add_request(request)


class FailingEngineCore:
    """Fails to load, like a bad model path."""

    def __init__(self, config: EngineConfig) -> None:
        raise FileNotFoundError("no such model: fake")

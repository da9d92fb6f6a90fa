"""The engine core in its own process.

The child runs EngineCore.step() in a tight loop and talks to the front end
over two ZeroMQ PUSH/PULL sockets carrying msgspec-encoded messages (see
docs/server.md for why). The loop only ever *polls* its input socket while it
has work, so HTTP traffic can never make a step wait; when idle it blocks on
the socket with a timeout so it can notice that its parent is gone.

Wire format: every message is a two-frame multipart [kind, msgpack payload].
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import msgspec
import zmq

from stoker.config import EngineConfig, ModelConfig
from stoker.engine.kv_disk_format import DiskLayout
from stoker.engine.kv_transfer_wire import layout_dict
from stoker.engine.params import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineStats,
    LoraAnswer,
    LoraCommand,
    SamplingParams,
)
from stoker.engine.pins import NO_DISK_TIER, PrefixAnswer, PrefixCommand

if TYPE_CHECKING:
    from stoker.engine.core import EngineCore
    from stoker.engine.kv_transfer_server import KVTransferServer
    from stoker.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_CORE = "stoker.engine.core:EngineCore"


class Core(Protocol):
    """What the engine process asks of its core: EngineCore, or a stand-in a test
    names (load_core_factory). EngineCore's extras, which test cores lack, are read
    with getattr: quantized_matmul, weights_summary, measure_row_costs,
    take_rejections and runner.kv_caches."""

    @property
    def max_model_len(self) -> int: ...
    @property
    def model_config(self) -> ModelConfig: ...
    @property
    def tokenizer(self) -> Tokenizer: ...
    def add_request(self, req: EngineCoreRequest) -> None: ...
    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    def step(self) -> list[EngineCoreOutput]: ...
    def stats(self) -> EngineStats: ...
    def reset_prefix_cache(self) -> int: ...


# front end -> engine
ADD = b"add"
ABORT = b"abort"
SHUTDOWN = b"shutdown"
RESET_PREFIX_CACHE = b"reset_prefix_cache"
PREFIXES = b"prefixes"
LORA = b"lora"
# engine -> front end
READY = b"ready"
OUTPUTS = b"out"
STATS = b"stats"
REJECT = b"reject"
FATAL = b"fatal"
PREFIX_CACHE_RESET = b"prefix_cache_reset"
PREFIX_ANSWER = b"prefix_answer"
LORA_ANSWER = b"lora_answer"

STATS_INTERVAL_S = 0.2
"""How often a busy engine pushes a stats snapshot; idle transitions push at once."""
IDLE_POLL_MS = 500
"""How long an idle engine blocks on its input before checking that its parent lives."""
LORA_POLL_MS = 10
"""How long an idle engine blocks on its input while a LoRA adapter loads, before answering for it."""
NO_LORA = "this engine does not serve LoRA adapters"


@dataclass
class EngineInfo:
    """What the engine tells the front end once it is loaded and warmed up."""

    max_model_len: int
    model_config: ModelConfig
    kv_capacity_tokens: int
    load_seconds: float
    pid: int
    tokenizer: bytes
    """The engine's own tokenizer, pickled, so both sides tokenize identically."""
    kv_cache_bytes: int = 0
    """Bytes the KV cache takes once every block is in use (the server's memory budget counts them)."""
    quantized_matmul: str = "none"
    """The int8 kernels' ISA path (avx512_amx, avx512_vnni, avx_vnni, avx2, portable), or none (weights dequantized)."""
    weights: str = ""
    """The weights' formats and size, e.g. 'Q4_1 (210 tensors) + Q8_0 (1) + F32 (61), 78 MiB'."""
    kv_layout: dict[str, str | int] | None = None
    """What must match between a prefill and a decode worker for KV blocks to move between them (model digest,
    KV dtype, block size, block bytes, layout version); None on kv_role both."""
    kv_transfer_port: int | None = None
    """The port a prefill worker's KV transfer server bound (kv_transfer_port, or the free one 0 took)."""


@dataclass
class Rejection:
    request_id: str
    message: str


@dataclass
class PrefixCacheReset:
    """The engine's answer to RESET_PREFIX_CACHE (whose payload is the ticket)."""

    ticket: int
    num_blocks: int
    """Cached blocks that no request held, now forgotten."""


encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
abort_decoder = msgspec.msgpack.Decoder(list[str])
outputs_decoder = msgspec.msgpack.Decoder(list[EngineCoreOutput])
stats_decoder = msgspec.msgpack.Decoder(EngineStats)
info_decoder = msgspec.msgpack.Decoder(EngineInfo)
rejection_decoder = msgspec.msgpack.Decoder(Rejection)
ticket_decoder = msgspec.msgpack.Decoder(int)
reset_decoder = msgspec.msgpack.Decoder(PrefixCacheReset)
prefix_command_decoder = msgspec.msgpack.Decoder(PrefixCommand)
prefix_answer_decoder = msgspec.msgpack.Decoder(PrefixAnswer)
lora_command_decoder = msgspec.msgpack.Decoder(LoraCommand)
lora_answer_decoder = msgspec.msgpack.Decoder(LoraAnswer)


if TYPE_CHECKING:

    def _engine_core_is_a_core(core: EngineCore) -> Core:
        """mypy holds EngineCore to the Core protocol here (no runtime cost)."""
        return core


def load_core_factory(spec: str) -> Callable[[EngineConfig], Core]:
    """'package.module:Name' -> the callable; tests swap in a fake core this way."""
    module_name, _, attr = spec.partition(":")
    factory: Callable[[EngineConfig], Core] = getattr(importlib.import_module(module_name), attr)
    return factory


def warm_up(core: Core) -> None:
    """One tiny greedy request end to end, so the first real request does not
    pay for lazy initialisation and /ready means "a forward pass worked"."""
    prompt = core.tokenizer.encode("Hello") or [0]
    request = EngineCoreRequest(
        request_id="__warmup__",
        prompt_token_ids=list(prompt)[:8],
        sampling_params=SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
        arrival_time=time.time(),
    )
    core.add_request(request)
    deadline = time.monotonic() + 600
    while core.has_unfinished_requests():
        core.step()
        if time.monotonic() > deadline:
            raise RuntimeError("warm-up did not finish")


def freeze_loaded_objects() -> None:
    """Move every object alive now (torch, transformers, the model, the
    tokenizer: all kept until the process ends) out of the garbage collector's
    generations, so the full collections that a decode loop's allocations
    trigger no longer walk them, and switch the collector back on. Profiled
    offline on the default model, the collector took ~6% of a one-stream
    decode. No collection first: on the default model it takes 0.1 s, on the
    way to ready, to free what start-up left behind, a few MB at most, kept
    instead. The collector is off from the engine's first import until here:
    importing torch and the model code makes ~300,000 objects that it would
    otherwise walk again and again (~0.2-0.3 s of the import's 1.2-1.5 s on
    two cores of a Zen 4), to find nothing to free; the engine serves nothing
    before it is ready, so nothing piles up meanwhile."""
    gc.freeze()
    gc.enable()


def _tensor_bytes(value: object, depth: int = 0) -> int:
    """Bytes of the tensors in a (nested) container of caches, whatever its layout."""
    import torch  # the engine process has it loaded; the front end never calls this

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if depth > 4:
        return 0
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v, depth + 1) for v in value)
    if hasattr(value, "__dict__"):
        return sum(_tensor_bytes(v, depth + 1) for v in vars(value).values())
    return 0


def _kv_cache_bytes(core: Core) -> int:
    caches = getattr(getattr(core, "runner", None), "kv_caches", None)
    # A core without a runner's caches (the tests' fake) holds no tensors: importing
    # torch only to count none would add 1-2 s to its engine's start.
    return 0 if caches is None else _tensor_bytes(caches)


def _kv_capacity_tokens(core: Core) -> int:
    stats = core.stats()
    return stats.kv_blocks_total * stats.block_size


def _kv_layout(core: Core) -> dict[str, str | int] | None:
    layout: DiskLayout | None = getattr(core, "kv_layout", None)
    return None if layout is None else layout_dict(layout)


def _kv_transfer_port(core: Core) -> int | None:
    server: KVTransferServer | None = getattr(core, "kv_server", None)
    return None if server is None else server.port


EngineArgs = tuple[EngineConfig, str, str, str, int, int]
"""run_engine's arguments: config, core_spec, input_addr, output_addr, parent_pid, log_level."""


def run_engine(
    config: EngineConfig,
    core_spec: str,
    input_addr: str,
    output_addr: str,
    parent_pid: int,
    log_level: int = logging.WARNING,
) -> None:
    """Entry point of the engine process (multiprocessing target). log_level is
    the server's: a spawned process starts with no logging configured, and the
    engine's start-up lines (weights and kernel path, attention backend, KV
    cache, speculative decoding) would otherwise be dropped."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    gc.disable()  # until ready: see freeze_loaded_objects
    # Signals sent to the whole process group (Ctrl-C, systemd's SIGTERM) must
    # not kill the engine under a draining front end: the front end alone
    # decides when the engine stops, by message, or by SIGKILL as a last resort.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctx = zmq.Context(io_threads=1)
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.connect(output_addr)
    try:
        start = time.monotonic()
        try:
            core = load_core_factory(core_spec)(config)
        except (ValueError, OSError) as exc:
            # What the user gave (a missing, corrupt or truncated file, a tensor type or
            # setting this machine cannot serve): the loader's message names it, so
            # that one line is the report, not a traceback through the loader.
            out.send_multipart([FATAL, " ".join(str(exc).split()).encode()])
            out.close(linger=2000)
            raise SystemExit(1) from None
        warm_up(core)
        freeze_loaded_objects()
        info = EngineInfo(
            max_model_len=int(core.max_model_len),
            model_config=core.model_config,
            kv_capacity_tokens=_kv_capacity_tokens(core),
            load_seconds=time.monotonic() - start,
            pid=os.getpid(),
            tokenizer=pickle.dumps(core.tokenizer),
            kv_cache_bytes=_kv_cache_bytes(core),
            quantized_matmul=getattr(core, "quantized_matmul", "none"),
            weights=getattr(core, "weights_summary", ""),
            kv_layout=_kv_layout(core),
            kv_transfer_port=_kv_transfer_port(core),
        )
        out.send_multipart([READY, encoder.encode(info)])
        out.send_multipart([STATS, encoder.encode(core.stats())])
        _loop(core, inp, out, parent_pid, getattr(core, "measure_row_costs", None))
    except Exception:
        out.send_multipart([FATAL, traceback.format_exc().encode()])
        out.close(linger=2000)
        raise SystemExit(1) from None
    finally:
        ctx.destroy(linger=1000)


def _loop(
    core: Core,
    inp: zmq.Socket[bytes],
    out: zmq.Socket[bytes],
    parent_pid: int,
    calibrate: Callable[[], None] | None = None,
) -> None:
    """calibrate (EngineCore's row-cost measurement; test cores have none) runs
    at the first idle poll: off the path to /ready, and after the front end
    has finished starting, whose work on the other core would skew it."""
    poller = zmq.Poller()
    poller.register(inp, zmq.POLLIN)
    take_rejections: Callable[[], list[tuple[str, str]]] | None = getattr(core, "take_rejections", None)
    # Pinned prefixes (EngineCore's; a test core without them answers that it has no disk tier).
    prefix_command: Callable[[PrefixCommand], None] | None = getattr(core, "prefix_command", None)
    take_prefix_answers: Callable[[], list[PrefixAnswer]] = getattr(core, "take_prefix_answers", list)
    # LoRA adapters (EngineCore's; a test core without them refuses every add).
    lora_command: Callable[[LoraCommand], list[EngineCoreOutput]] | None = getattr(core, "lora_command", None)
    take_lora_answers: Callable[[], list[LoraAnswer]] = getattr(core, "take_lora_answers", list)
    loras_loading: Callable[[], bool] = getattr(core, "loras_loading", lambda: False)
    # A prefill worker's rooms pulled or expired while idle give their blocks back (EngineCore's).
    housekeep: Callable[[], None] = getattr(core, "housekeep", lambda: None)
    last_stats = 0.0
    sent: EngineStats | None = None
    while True:
        for lora_answer in take_lora_answers():
            out.send_multipart([LORA_ANSWER, encoder.encode(lora_answer)])
        busy = core.has_unfinished_requests()
        if not busy and not poller.poll(LORA_POLL_MS if loras_loading() else IDLE_POLL_MS):
            if calibrate is not None:
                calibrate()
                calibrate = None
            if os.getppid() != parent_pid:
                return  # orphaned: the front end is gone, nobody will read our output
            housekeep()
            # Threads beside the step loop (the disk tier's writer) move counters while it idles:
            # the front end's /ready and /metrics should not keep the snapshot taken as it went idle.
            idle = core.stats()
            if idle != sent:
                out.send_multipart([STATS, encoder.encode(idle)])
                sent = idle
            continue
        # Take everything that arrived, never waiting: adds join the next step,
        # aborts free their blocks before it.
        stats_due = False
        while True:
            try:
                kind, payload = inp.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if kind == ADD:
                request = request_decoder.decode(payload)
                try:
                    core.add_request(request)
                except ValueError as exc:
                    out.send_multipart([REJECT, encoder.encode(Rejection(request.request_id, str(exc)))])
            elif kind == ABORT:
                outputs = core.abort_requests(abort_decoder.decode(payload))
                if outputs:
                    out.send_multipart([OUTPUTS, encoder.encode(outputs)])
                stats_due = True
            elif kind == RESET_PREFIX_CACHE:
                # Between steps: no block changes hands while the cache is swept.
                num_blocks = int(core.reset_prefix_cache())
                reset = PrefixCacheReset(ticket_decoder.decode(payload), num_blocks)
                out.send_multipart([PREFIX_CACHE_RESET, encoder.encode(reset)])
                stats_due = True
            elif kind == PREFIXES:
                command = prefix_command_decoder.decode(payload)
                if prefix_command is None:
                    answer = PrefixAnswer(command.ticket, error=NO_DISK_TIER)
                    out.send_multipart([PREFIX_ANSWER, encoder.encode(answer)])
                else:
                    prefix_command(command)  # a pin becomes a request, answered once it has run
            elif kind == LORA:
                lora = lora_command_decoder.decode(payload)
                if lora_command is None:
                    refusal = LoraAnswer(lora.ticket, error=NO_LORA)
                    out.send_multipart([LORA_ANSWER, encoder.encode(refusal)])
                else:
                    # An add is answered once its load is done (take_lora_answers); a remove ends the
                    # requests still naming the adapter.
                    outputs = lora_command(lora)
                    if outputs:
                        out.send_multipart([OUTPUTS, encoder.encode(outputs)])
                    stats_due = True
            elif kind == SHUTDOWN:
                close: Callable[[], None] | None = getattr(core, "close", None)
                if close is not None:
                    close()  # EngineCore: the disk tier writes what it has queued
                return
        if core.has_unfinished_requests():
            if not busy:
                stats_due = True  # a burst begins: admission should see the new queue at once
            outputs = core.step()
            if outputs:
                out.send_multipart([OUTPUTS, encoder.encode(outputs)])
            if take_rejections is not None:
                # Refused after add_request returned: a grammar the worker failed to compile.
                for request_id, message in take_rejections():
                    out.send_multipart([REJECT, encoder.encode(Rejection(request_id, message))])
            if not core.has_unfinished_requests():
                stats_due = True  # went idle: the front end should see the freed blocks now
        for answer in take_prefix_answers():
            out.send_multipart([PREFIX_ANSWER, encoder.encode(answer)])
        now = time.monotonic()
        if stats_due or now - last_stats >= STATS_INTERVAL_S:
            sent = core.stats()
            out.send_multipart([STATS, encoder.encode(sent)])
            last_stats = now

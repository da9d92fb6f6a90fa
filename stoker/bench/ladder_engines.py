"""The servers `stoker bench ladder` starts on one rung's GGUF: stoker itself,
llama.cpp's llama-server (and llama-bench's prompt speed beside it), and vLLM's
CPU backend on the same weights written as a bf16 Hugging Face folder. Each on
127.0.0.1 and a free port, its output in a log file; each one's memory is
estimated first, so a rung that would not fit is skipped rather than swapped."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from stoker.bench.ladder_report import RungFacts
from stoker.bench.pd_workers import Child
from stoker.bench.prefix_restart import free_port
from stoker.bench.server_ready import wait_until_ready
from stoker.bench.soak import memory_of, process_tree

LLAMA_BUILD_BIN = Path(os.environ.get("LLAMA_DIR", "/tmp/llamacpp")) / "build" / "bin"
"""Where the build-llama-server tool puts llama-server and llama-bench."""
LLAMA_BENCH_TIMEOUT_S = 1800.0
HF_FOLDER_TIMEOUT_S = 3600.0
GiB = 1 << 30
_TELLING = re.compile(r"error|failed|unsupported|refus|invalid|unknown", re.IGNORECASE)
# Beyond weights and KV cache, measured on the default model (docs/perf/README.md: the
# engine process 415 MB, the front end 250 MB) and rounded up; vLLM's from its start-up.
OVERHEAD = {"stoker": 1 * GiB, "llama-server": GiB // 2, "vllm": 3 * GiB}


@dataclass(frozen=True)
class Limits:
    """What every engine is asked for, alike."""

    max_seqs: int
    max_model_len: int
    kv_tokens: int
    threads: int


@dataclass
class Engine:
    """One server of one rung: how to start it and what it should take."""

    name: str
    argv: list[str]
    health_path: str
    memory_estimate: int
    env: dict[str, str]


def stoker_engine(gguf: Path, limits: Limits, work: Path, facts: RungFacts) -> Engine:
    port = free_port()
    argv = [sys.executable, "-m", "stoker.cli", "serve", "--model", str(gguf), "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--no-embedding-model", "--max-num-seqs", str(limits.max_seqs)]
    argv += ["--max-model-len", str(limits.max_model_len), "--kv-cache-tokens", str(limits.kv_tokens)]
    argv += ["--num-threads", str(limits.threads)]
    # No speculation: a random-weight model's greedy output loops, so prompt lookup's
    # drafts would be accepted almost always and the figures would measure the noise's
    # repetition, not the engine (llama-server and vLLM do not speculate by default either).
    argv += ["--speculative-method", "none"]
    # Its own key database: the user's keys would close the server to the bench.
    env = {**os.environ, "STOKER_DB": str(work / "stoker.db")}
    memory = gguf.stat().st_size + limits.kv_tokens * facts.kv_bytes_per_token + OVERHEAD["stoker"]
    return Engine("stoker", argv, "/ready", memory, env)


def llama_binaries(given: str | None) -> tuple[Path | None, str]:
    """llama-server's path (given, else where build-llama-server puts it, else on PATH), or why none."""
    if given:
        path = Path(given)
        return (path, "") if os.access(path, os.X_OK) else (None, f"--llama-server {given}: not an executable")
    for candidate in (LLAMA_BUILD_BIN / "llama-server", shutil.which("llama-server")):
        if candidate and os.access(candidate, os.X_OK):
            return Path(candidate), ""
    return None, f"no llama-server in {LLAMA_BUILD_BIN} or on PATH (build it: shared/tools/build-llama-server)"


def llama_engine(binary: Path, gguf: Path, limits: Limits, facts: RungFacts) -> Engine:
    port = free_port()
    argv = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    # One KV cache shared by the slots (--kv-unified), as stoker's is: without it each of
    # the -np slots gets -c / np tokens and a 2,048-token prompt fits none.
    argv += ["-np", str(limits.max_seqs), "-c", str(limits.kv_tokens), "--kv-unified", "-t", str(limits.threads)]
    memory = gguf.stat().st_size + limits.kv_tokens * facts.kv_bytes_per_token + OVERHEAD["llama-server"]
    return Engine("llama-server", argv, "/health", memory, dict(os.environ))


def vllm_engine(python: str, folder: Path, limits: Limits, facts: RungFacts) -> Engine:
    port = free_port()
    kv_gib = max(1, math.ceil(limits.kv_tokens * facts.kv_bytes_per_token / GiB))
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
    argv += ["--served-model-name", "ladder", "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16"]
    argv += ["--max-model-len", str(limits.max_model_len), "--max-num-seqs", str(limits.max_seqs)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_gib)}
    memory = 2 * facts.parameters + kv_gib * GiB + OVERHEAD["vllm"]
    return Engine("vllm", argv, "/health", memory, env)


def url_of(engine: Engine) -> str:
    return f"http://127.0.0.1:{engine.argv[engine.argv.index('--port') + 1]}"


class Started:
    """A running engine: its process, start-to-ready time and resident memory after load."""

    def __init__(self, engine: Engine, work: Path, ready_timeout: float) -> None:
        self.engine = engine
        self.url = url_of(engine)
        started = time.perf_counter()
        self.child = Child(engine.name, engine.argv, work, engine.env)
        self.error = self._wait(ready_timeout)
        self.ready_s = time.perf_counter() - started
        self.rss_after_load = self.rss() if self.error is None else 0

    def _wait(self, timeout: float) -> str | None:
        # Polled every 20 ms: start to ready is a figure of its own here, and a 0.2 s poll
        # added 0-0.2 s to each engine's (a tenth of a small rung's whole start).
        why = wait_until_ready(self.url, self.child.proc, timeout, interval=0.02, path=self.engine.health_path)
        if why is None:
            return None
        self.child.stop()
        return self._why(why)

    def _why(self, reason: str) -> str:
        """The reason and the log's last line that says what went wrong (the servers
        log their shutdown after the refusal), else its last line."""
        lines = [line.strip() for line in self.child.log_path.read_text(errors="replace").splitlines() if line.strip()]
        telling = [line for line in lines if _TELLING.search(line)] or lines
        return f"{self.engine.name} {reason}" + (f": {telling[-1][:300]}" if telling else "")

    def rss(self) -> int:
        """Resident bytes of the server and all its children."""
        return sum((memory_of(pid) or {}).get("rss", 0) for pid in process_tree(self.child.proc.pid))

    def stop(self) -> None:
        self.child.stop()


def llama_bench(binary: Path, gguf: Path, threads: int, prompts: tuple[int, ...]) -> dict[int, float] | str:
    """llama-bench's prompt tokens/s for each prompt length (pp512 ...), or why not."""
    bench = binary.with_name("llama-bench")
    if not os.access(bench, os.X_OK):
        return f"no llama-bench beside {binary}"
    argv = [str(bench), "-m", str(gguf), "-p", ",".join(map(str, prompts)), "-n", "0", "-t", str(threads)]
    argv += ["-r", "3", "-o", "json"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=LLAMA_BENCH_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return f"llama-bench did not finish in {LLAMA_BENCH_TIMEOUT_S:g} s"
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        return f"llama-bench exited with {done.returncode}: {lines[-1][:200] if lines else ''}"
    return {int(row["n_prompt"]): float(row["avg_ts"]) for row in json.loads(done.stdout) if row.get("n_prompt")}


def write_hf_folder(gguf: Path, folder: Path) -> Path:
    """The GGUF's weights as a bf16 Hugging Face folder (for vLLM), written once in a
    child process: stoker's GGUF loader dequantizes them with gguf-py's dequantize
    (the numbers transformers' own GGUF loading gives), in HF names and layouts."""
    if (folder / "config.json").exists():
        return folder
    code = "import sys; from stoker.bench.ladder_engines import _write_hf; _write_hf(sys.argv[1], sys.argv[2])"
    done = subprocess.run(
        [sys.executable, "-c", code, str(gguf), str(folder)],
        capture_output=True,
        text=True,
        timeout=HF_FOLDER_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise RuntimeError(f"writing the bf16 folder failed: {lines[-1] if lines else done.returncode}")
    return folder


def _write_hf(gguf: str, folder: str) -> None:
    import torch
    from safetensors.torch import save_file

    from stoker.models.loader import load_model
    from stoker.models.registry import architecture

    loaded = load_model(gguf, torch.bfloat16, quantization="none")
    c = loaded.config
    partial = Path(folder + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    weights = {name: t.contiguous() for name, t in loaded.weights.items() if isinstance(t, torch.Tensor)}
    if c.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # safetensors refuses a tensor stored twice
    save_file(weights, str(partial / "model.safetensors"))
    # transformers' model_type is llama.cpp's general.architecture for the families the ladder writes.
    facts = architecture(c.architecture).gguf
    model_type = facts.architecture if facts is not None else "llama"
    config = {
        "architectures": [c.architecture],
        "model_type": model_type,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.attention_bias,
        "hidden_act": "silu",
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_ids[0] if c.eos_token_ids else None,
        "torch_dtype": "bfloat16",
    }
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    loaded.tokenizer.hf.save_pretrained(str(partial))
    os.replace(partial, folder)

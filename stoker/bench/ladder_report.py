"""What `stoker bench ladder` knows about the machine and each rung, and how it
writes its report: the CPU and its flags, a stream test of memory bandwidth,
each file's weight bytes per decoded token (so its roofline), and the result as
ladder.md (tables), ladder.json (everything) and ladder.png (the plot)."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FLAGS_THAT_MATTER = (
    *("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
    *("avx512_bf16", "avx512_fp16", "avx512_vbmi", "amx_tile", "amx_int8", "amx_bf16"),
)
STREAM_BYTES = 256 << 20
"""Each stream buffer: far larger than any CPU's last-level cache per core."""


@dataclass(frozen=True)
class RungFacts:
    """A GGUF's sizes as the harness needs them, read from its header."""

    name: str
    tensor_bytes: int
    decode_bytes_per_token: int
    """Weights one decode step reads: all but an untied embedding (of which one row)."""
    kv_bytes_per_token: int
    """bf16 k and v of every layer."""
    parameters: int
    vocab: int


def facts_of(name: str, path: Path) -> RungFacts:
    """The sizes of any GGUF file, from its header (nothing is read but the header)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    arch = field("general.architecture")
    tensors = {t.name: t for t in reader.tensors}
    untied = "output.weight" in tensors
    total = sum(int(t.n_bytes) for t in reader.tensors)
    embedding = tensors.get("token_embd.weight")
    decode = total - (int(embedding.n_bytes) if untied and embedding is not None else 0)
    layers = int(field(f"{arch}.block_count") or 0)
    heads = int(field(f"{arch}.attention.head_count") or 1)
    kv_heads = int(field(f"{arch}.attention.head_count_kv") or heads)
    head_dim = int(field(f"{arch}.embedding_length") or 0) // heads
    return RungFacts(
        name=name,
        tensor_bytes=total,
        decode_bytes_per_token=decode,
        kv_bytes_per_token=2 * layers * kv_heads * head_dim * 2,
        parameters=sum(int(t.n_elements) for t in reader.tensors),
        vocab=int(embedding.data.shape[0]) if embedding is not None else 0,
    )


def machine() -> dict[str, Any]:
    """The CPU model, its core count and the flags that decide which kernels run."""
    model, flags = platform.processor() or "unknown", set[str]()
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "flags": [flag for flag in FLAGS_THAT_MATTER if flag in flags],
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
    }


def stream_bandwidth(repeats: int = 5, nbytes: int | None = None) -> dict[str, float]:
    """Memory bandwidth in bytes/s on all of torch's threads, best of `repeats`:
    copy (b = a: 2 bytes moved per byte) and triad (a = b + 3c: 3 per byte), as STREAM counts them."""
    import torch

    nbytes = nbytes or STREAM_BYTES
    n = nbytes // 4
    a, b, c = torch.ones(n), torch.ones(n), torch.ones(n)
    best = {"copy": 0.0, "triad": 0.0}
    for _ in range(repeats):
        started = time.perf_counter()
        b.copy_(a)
        best["copy"] = max(best["copy"], 2 * nbytes / (time.perf_counter() - started))
        started = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        best["triad"] = max(best["triad"], 3 * nbytes / (time.perf_counter() - started))
    return best


def cold_read_seconds(path: Path) -> float:
    """Seconds to read the file with its pages dropped from the page cache first
    (posix_fadvise DONTNEED: no root needed; pages another process maps stay)."""
    with open(path, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        started = time.perf_counter()
        while f.read(16 << 20):
            pass
        return time.perf_counter() - started


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


ROWS = [
    ("one stream, out tok/s (end to end)", "one_stream_tok_s", "{:.1f}"),
    ("decode alone, tok/s (1 / TPOT p50)", "decode_tok_s", "{:.1f}"),
    ("decode ÷ roofline", "decode_of_roofline", "{:.0%}"),
]


def _rows(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows = list(ROWS)
    rows += [(f"{c} streams, out tok/s", f"streams_{c}_tok_s", "{:.1f}") for c in result["streams"]]
    for length in result["prefill"]:
        rows.append((f"prefill {length}, tok/s (TTFT of one request)", f"prefill_{length}_tok_s", "{:.0f}"))
        rows.append((f"llama-bench pp{length}, tok/s", f"pp{length}", "{:.0f}"))
        rows.append((f"stoker prefill {length} ÷ llama-bench pp{length}", f"prefill_{length}_of_pp", "{:.2f}x"))
    rows += [
        ("resident memory, MB (the larger of after load and after the phases)", "rss_mb", "{:.0f}"),
        ("÷ (file + KV cache)", "rss_of_file_kv", "{:.2f}"),
        ("start to ready, s", "ready_s", "{:.1f}"),
    ]
    return rows


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    bw = result["bandwidth"]
    lines = [
        f"# Size ladder: {m['cpu']}, {m['cores']} cores",
        "",
        f"Flags: {', '.join(m['flags']) or 'none of note'}. Memory bandwidth (torch, all threads): "
        f"copy {bw['copy'] / 1e9:.1f} GB/s, triad {bw['triad'] / 1e9:.1f} GB/s. {result['date']}.",
        "",
        f"`{result['command']}`",
        "",
    ]
    for skipped in result["skipped"]:
        lines.append(f"- skipped: {skipped}")
    for rung in result["rungs"]:
        engines = list(rung["engines"])
        lines += [
            "",
            f"## {rung['name']}",
            "",
            f"{rung['file_bytes'] / 1e6:.0f} MB file, {rung['parameters'] / 1e9:.2f} B parameters, "
            f"{rung['decode_bytes_per_token'] / 1e6:.0f} MB of weights per decoded token: roofline "
            f"{rung['roofline_tok_s']:.1f} tok/s at the triad bandwidth. Cold read of the file "
            f"{rung['cold_read_s']:.1f} s.",
        ]
        if rung.get("greedy"):
            lines.append(f"Greedy, fused decoder against the torch path: {rung['greedy']['summary']}.")
        header = ["", *engines, *(f"stoker ÷ {e}" for e in engines[1:])]
        lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for label, key, fmt in _rows(result):
            values = [rung["engines"][e].get(key) for e in engines]
            if all(v is None for v in values):
                continue
            cells = [fmt.format(v) if v is not None else "" for v in values]
            base = values[0]
            for v in values[1:]:
                cells.append(f"{base / v:.2f}x" if key.endswith("_tok_s") and base and v else "")
            lines.append("| " + " | ".join([label, *cells]) + " |")
        for line in rung["notes"]:
            lines.append(f"- {line}")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Per rung: each engine's decode and 16-stream tokens/s, and the decode roofline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rungs = result["rungs"]
    engines = sorted({e for r in rungs for e in r["engines"]}, key=["stoker", "llama-server", "vllm"].index)
    top = max(result["streams"], default=None)
    panels = [("decode_tok_s", "decode alone, tok/s")]
    if top is not None:
        panels.append((f"streams_{top}_tok_s", f"{top} streams, out tok/s"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    width = 0.8 / max(1, len(engines))
    for ax, (key, title) in zip(axes[0], panels):
        for i, engine in enumerate(engines):
            # a phase a rung did not run draws no bar (NaN), not a bar of 0
            values = [r["engines"].get(engine, {}).get(key) or math.nan for r in rungs]
            ax.bar([x + i * width for x in range(len(rungs))], values, width, label=engine)
        if key == "decode_tok_s":
            ax.scatter(
                [x + 0.4 - width / 2 for x in range(len(rungs))],
                [r["roofline_tok_s"] for r in rungs],
                marker="_",
                s=800,
                color="black",
                label="roofline",
            )
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rungs))], [r["name"] for r in rungs], rotation=20)
        ax.set_title(title)
        ax.legend()
    fig.suptitle(result["machine"]["cpu"])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(result: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "ladder.json", out / "ladder.md"]
    paths[0].write_text(json.dumps(result, indent=2))
    paths[1].write_text(markdown(result))
    if result["rungs"]:
        paths.append(out / "ladder.png")
        plot(result, paths[-1])
    return paths

"""Resident memory of the engine on a large quantized GGUF, against the file's size
and the KV cache: issue 11's target is RSS <= 1.3 x file + KV.

    python -m stoker.bench.gguf_memory [--gguf PATH] [--keep] [--tokens N] [--kv-cache-tokens N]

Without --gguf it writes a 1B-class Q4_K_M file of random blocks
(synthetic_gguf.ONE_B, 0.7 GB) to a temporary folder. Run in a process of its
own: VmRSS is the process's, so anything else loaded in it would count. Prints
one JSON object (bytes; rss_* from /proc/self/status).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def _status() -> dict[str, int]:
    """VmRSS, RssAnon, RssFile of this process, in bytes."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def measure(gguf: Path, tokens: int, kv_cache_tokens: int) -> dict[str, object]:
    from stoker import LLM, SamplingParams  # imported before the first reading: not part of the model

    before = _status()
    started = time.perf_counter()
    llm = LLM(str(gguf), dtype="float32", kv_cache_tokens=kv_cache_tokens, enable_prefix_caching=False)
    loaded_s = time.perf_counter() - started
    after_load = _status()
    core = llm.engine
    kv_bytes = sum(k.nbytes + v.nbytes for k, v in core.runner.kv_caches)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    out = llm.generate(["The quick brown fox jumps over the lazy dog. " * 4], params)
    generate_s = time.perf_counter() - started
    after = _status()
    file_bytes = gguf.stat().st_size
    return {
        "file_bytes": file_bytes,
        "kv_cache_bytes": kv_bytes,
        "kv_cache_tokens": core.kv_capacity_tokens,
        "rss_before_load": before["VmRSS"],
        "rss_after_load": after_load["VmRSS"],
        "rss_after_generate": after["VmRSS"],
        "rss_anon_after_generate": after["RssAnon"],
        "rss_file_after_generate": after["RssFile"],
        "peak_rss": after["VmHWM"],
        "generated_tokens": len(out[0].outputs[0].token_ids),
        "load_seconds": round(loaded_s, 2),
        "generate_seconds": round(generate_s, 2),
        "rss_over_file_plus_kv": round(after["VmRSS"] / (file_bytes + kv_bytes), 3),
        "peak_over_file_plus_kv": round(after["VmHWM"] / (file_bytes + kv_bytes), 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=None, help="a GGUF to measure (default: write a synthetic 1B one)")
    parser.add_argument("--keep", action="store_true", help="keep the synthetic file (its path is printed)")
    parser.add_argument("--tokens", type=int, default=8, help="tokens to generate")
    parser.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=2048,
        help="KV capacity (default one 2048-token context, so the cache does not dwarf the weights in the ratio)",
    )
    args = parser.parse_args(argv)
    if args.gguf is not None:
        print(json.dumps(measure(args.gguf, args.tokens, args.kv_cache_tokens)))
        return 0
    from stoker.bench.synthetic_gguf import ONE_B, write_llama_gguf

    folder = tempfile.mkdtemp(prefix="stoker-1b-")
    path = write_llama_gguf(Path(folder) / "synthetic-1b-q4_k_m.gguf", ONE_B)
    try:
        result = measure(path, args.tokens, args.kv_cache_tokens)
        result["parameters"] = ONE_B.parameters()
        if args.keep:
            result["gguf"] = str(path)
        print(json.dumps(result))
    finally:
        if not args.keep:
            os.unlink(path)
            os.rmdir(folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

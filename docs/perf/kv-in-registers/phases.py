"""Prefill and decode of the offline workload timed apart, in one engine.

`python docs/perf/kv-in-registers/phases.py [KV_CACHE_DTYPE]` (PYTHONPATH=TREE
to time another tree): the issue's 32 prompts of 100-1000 tokens, first with
max_tokens=1 (the prefill phase, and the process CPU seconds it took), then the
same prompts with 128 tokens out, which find all but each prompt's last
partial block in the prefix cache: mostly the decode phase. ONLY_PREFILL=1
stops after the first. BLOCK_SIZE sets the KV block size (default 16)."""

from __future__ import annotations

import os
import resource
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from stoker import LLM, SamplingParams
from stoker.bench.offline import prompt_lengths
from stoker.bench.workload import load_tokenizer, synthetic_token_ids
from stoker.config import default_model_path


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    kv = sys.argv[1] if len(sys.argv) > 1 else "int8"
    prompts = synthetic_token_ids(load_tokenizer(default_model_path()), prompt_lengths("100:1000", 32, 0), 0)
    llm = LLM(
        model=None,
        dtype="float32",
        max_num_seqs=32,
        kv_cache_dtype=kv,
        block_size=int(os.environ.get("BLOCK_SIZE", "16")),
    )
    greedy = {"ignore_eos": True, "temperature": 0}
    llm.generate([prompts[0][::-1][:32]], SamplingParams(max_tokens=4, **greedy), use_tqdm=False)
    cpu, t = cpu_seconds(), time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
    prefill, prefill_cpu = time.perf_counter() - t, cpu_seconds() - cpu
    line = f"{os.environ.get('PYTHONPATH', 'this tree')} kv={kv} prefill {prefill:.2f}s (cpu {prefill_cpu:.2f}s)"
    if not os.environ.get("ONLY_PREFILL"):
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=128, **greedy), use_tqdm=False)
        line += f"  cached prefill + decode128 {time.perf_counter() - t:.2f}s"
    print(line)


if __name__ == "__main__":
    main()

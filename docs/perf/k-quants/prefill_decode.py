"""Prefill and decode speed of a GGUF through stoker's offline LLM, for the tree
on PYTHONPATH: a 512-token prompt with 1 token out (prefill), and an 8-token
prompt with 65 out (decode; the first token is the prompt's). Best of 3 each,
greedy, random token ids, so random-weight files measure as well as real ones.

    python -c 'from pathlib import Path; from stoker.bench.synthetic_gguf import ONE_B, write_llama_gguf
    write_llama_gguf(Path("q4km.gguf"), ONE_B)'      # 1.1B, Q4_K with v, down, LM head Q6_K
    PYTHONPATH=TREE python docs/perf/k-quants/prefill_decode.py q4km.gguf
"""

from __future__ import annotations

import random
import sys
import time

from stoker import LLM, SamplingParams


def token_ids(count: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, vocab - 10) for _ in range(count)]


def main() -> None:
    llm = LLM(sys.argv[1], kv_cache_tokens=8192, max_model_len=2048)
    vocab = llm.engine.model_config.vocab_size
    greedy = {"temperature": 0.0, "ignore_eos": True}
    llm.generate(token_ids(16, 99, vocab), SamplingParams(max_tokens=2, **greedy))  # warm-up
    prefill, decode = [], []
    for rep in range(3):
        started = time.perf_counter()
        llm.generate(token_ids(512, rep, vocab), SamplingParams(max_tokens=1, **greedy))
        prefill.append(time.perf_counter() - started)
        started = time.perf_counter()
        llm.generate(token_ids(8, 100 + rep, vocab), SamplingParams(max_tokens=65, **greedy))
        decode.append(time.perf_counter() - started)
    best_prefill = min(prefill)
    print(
        f"prefill 512: {best_prefill * 1000:.0f} ms ({512 / best_prefill:.0f} tok/s)  "
        f"decode 64: {64 / min(decode):.2f} tok/s"
    )


if __name__ == "__main__":
    main()

"""Decode tok/s of the default model with the KV cache in auto (fp32) vs int8,
alternating runs. Arguments: context tokens, new tokens, rounds, threads.
Prompts are prefilled once first, so the timed runs hit the prefix cache and
time (almost only) decode steps; speculation off, so only the cache differs."""

import sys
import time

import torch

from stoker import LLM, SamplingParams

CONTEXT, NEW, ROUNDS = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
llms = {
    dt: LLM(
        None,
        kv_cache_dtype=dt,
        speculative_method="none",
        num_threads=int(sys.argv[4]),
        kv_cache_tokens=40000,
        max_model_len=4096,
    )
    for dt in ("auto", "int8")
}
for c in (1, 16):
    g = torch.Generator().manual_seed(c)
    prompts = [torch.randint(100, 40000, (CONTEXT,), generator=g).tolist() for _ in range(c)]
    for llm in llms.values():  # prefill once: the timed runs hit the prefix cache
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0))
    rates = {dt: [] for dt in llms}
    for _ in range(ROUNDS):
        for dt, llm in llms.items():
            t = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=NEW, min_tokens=NEW, temperature=0))
            rates[dt].append(c * NEW / (time.perf_counter() - t))
    for dt, r in rates.items():
        print(
            f"c={c} context={CONTEXT} kv={dt}: " + " ".join(f"{x:.1f}" for x in r) + f" tok/s (best {max(r):.1f})",
            flush=True,
        )

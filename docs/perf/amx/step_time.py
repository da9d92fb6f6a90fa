"""A decode step of the fused decoder in process: `LLM.generate` on SEQS
sequences of 8-token prompts, the best of 3 runs of N tokens, as ms a step
(and their mean). The tree whose kernels run is the one on PYTHONPATH;
paired_step.sh runs two at once. The weights' repack (quant/repack.py) is
waited for first: in process, back-to-back steps can keep its thread from the
weights lock for many seconds, and the steps would time the blocks' kernels.

    THREADS=1 SEQS=16 python docs/perf/amx/step_time.py GGUF [N]
"""

from __future__ import annotations

import os
import sys
import time

import torch

from stoker.engine.llm import LLM
from stoker.engine.params import SamplingParams


def main() -> None:
    threads = int(os.environ.get("THREADS", "2"))
    seqs = int(os.environ.get("SEQS", "16"))
    torch.set_num_threads(threads)
    llm = LLM(
        model=sys.argv[1],
        max_num_seqs=16,
        max_model_len=428,
        kv_cache_tokens=6912,
        speculative_method="none",
        num_threads=threads,
    )
    llm.engine.runner.model.repack.finish()
    prompts = [[100 + 7 * i + j for j in range(8)] for i in range(seqs)]
    params = SamplingParams(max_tokens=int(sys.argv[2]) if len(sys.argv) > 2 else 32, ignore_eos=True, temperature=0)
    llm.generate(prompts, params)
    runs = [_timed(llm, prompts, params) * 1e3 / params.max_tokens for _ in range(3)]
    print(f"{min(runs):.1f} ms a step ({seqs} rows, {params.max_tokens} steps, best of 3; mean {sum(runs) / 3:.1f})")


def _timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    start = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()

"""Paired A/B of the fused decoder stack in one process: decode steps alternate call by call
between another build of decoder_layer.c (BASE_SO: the same Model and Step structs, the same
bits) and this tree's, so both meet the same load on a shared machine. Greedy, one stream.

    python docs/perf/decode-step/paired_stack.py MODEL.gguf THREADS STEPS BASE_SO [PROMPT_LEN]
"""

import ctypes
import os
import random
import statistics
import sys
import time
from typing import Any

import stoker.models.fused_decoder as fused_decoder
from stoker.engine.llm import LLM
from stoker.engine.params import SamplingParams

path, threads, steps, base_so = os.path.expanduser(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
prompt_len = int(sys.argv[5]) if len(sys.argv) > 5 else 200
llm = LLM(path, num_threads=threads, speculative_method="none", max_num_seqs=4)
this = fused_decoder._current_library()
assert this is not None
base = ctypes.CDLL(base_so)
base.decoder_forward.restype = ctypes.c_int
base.decoder_forward.argtypes = this.decoder_forward.argtypes
libraries = {"base": base, "this": this}
times: dict[str, list[float]] = {"base": [], "this": []}
calls = [0]


class Timed:
    def __init__(self, name: str) -> None:
        self.name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(libraries[self.name], attr)

    def decoder_forward(self, *args: Any) -> int:
        start = time.perf_counter()
        rc = libraries[self.name].decoder_forward(*args)
        times[self.name].append(time.perf_counter() - start)
        return int(rc)


def alternate() -> Timed:
    calls[0] += 1
    return Timed("base" if calls[0] % 2 else "this")


fused_decoder._current_library = alternate  # type: ignore[assignment]
random.seed(0)
prompt = [random.randrange(1000, 30000) for _ in range(prompt_len)]
llm.generate([prompt], SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True), use_tqdm=False)
for name, values in times.items():
    d = sorted(values[2:])  # past the prefill
    print(
        f"{name}: threads={threads} calls={len(d)} min {d[0] * 1e3:.2f} p10 {d[len(d) // 10] * 1e3:.2f}"
        f" p50 {statistics.median(d) * 1e3:.2f} ms"
    )

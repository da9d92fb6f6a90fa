"""What one engine step of each shape costs on a GGUF: n decode rows (each its
own sequence, CTX tokens of context), a prefill chunk, or both in one step, as
the scheduler hands them to the runner (runner.execute_model: the fused decoder
stack, the LM head, the sampler). The KV blocks are real cache blocks holding
zeros, so attention reads as many keys as a real step of that context.

    python docs/perf/decode-step/batch_shapes.py FILE [SHAPE ...]

SHAPE: dN (N decode rows), pN (one N-token prompt chunk), dN+pM (both in one
step); default d1 d2 d3 d4 d5 d6 d8 d12 d16 p512 d13+p300. THREADS (default 1):
one thread times CPU time (time.process_time), which a loaded machine inflates
far less than it stalls two OpenMP threads at their barriers; with more,
wall-clock time. Each figure is the minimum of REPEATS calls (default 5) after
one warm-up call. CTX: context of each decode row (default 250)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator

from stoker import LLM
from stoker.engine.outputs import ScheduledRequest, SchedulerOutput
from stoker.engine.params import SamplingParams
from stoker.engine.sampler import SampleRow

BLOCK = 16
SHAPES = ["d1", "d2", "d3", "d4", "d5", "d6", "d8", "d12", "d16", "p512", "d13+p300"]


def main() -> None:
    path, shapes = sys.argv[1], sys.argv[2:] or SHAPES
    threads, repeats = int(os.environ.get("THREADS", "1")), int(os.environ.get("REPEATS", "5"))
    ctx = int(os.environ.get("CTX", "250"))
    clock = time.process_time if threads == 1 else time.perf_counter
    llm = LLM(
        path,
        dtype="float32",
        max_model_len=2056,
        kv_cache_tokens=8192,
        num_threads=threads,
        enable_prefix_caching=False,
        speculative_method="none",
    )
    runner = llm.engine.runner
    runner.model.repack.finish()  # the served steady state: every packable layer on its panels
    greedy = SampleRow(SamplingParams(temperature=0.0), [], [], None, [])
    num_blocks = runner.kv_caches[0][0].shape[0]

    def sequence(blocks: Iterator[int], name: str, tokens: int, computed: int) -> ScheduledRequest:
        """A sequence of its own blocks (block 0 is the null block)."""
        table = [next(blocks) for _ in range(-(-(computed + tokens) // BLOCK))]
        return ScheduledRequest((name, 0), [7] * tokens, computed, table, greedy)

    for shape in shapes:
        blocks = iter(range(1, num_blocks))
        seqs: list[ScheduledRequest] = []
        for part in shape.split("+"):
            count = int(part[1:])
            if part[0] == "d":
                seqs += [sequence(blocks, f"d{i}", 1, ctx) for i in range(count)]
            else:
                seqs.append(sequence(blocks, "p", count, 0))
        step = SchedulerOutput(seqs)
        runner.execute_model(step)
        times = []
        for _ in range(repeats):
            started = clock()
            runner.execute_model(step)
            times.append(clock() - started)
        rows = sum(s.num_new_tokens for s in seqs)
        best = min(times) * 1000
        print(f"{shape:10s} {best:9.1f} ms  {best / rows:7.2f} ms a row", flush=True)


if __name__ == "__main__":
    main()

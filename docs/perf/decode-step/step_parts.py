"""Where one decode step's time goes: one stream, greedy, a random 200-token prompt, through
the LLM API's EngineCore, each part timed around its call (min, p10, median over the decode steps).

    python docs/perf/decode-step/step_parts.py MODEL.gguf [STEPS [THREADS]]
"""

import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from stoker.engine.llm import LLM
from stoker.engine.params import SamplingParams

path = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 64
threads = int(sys.argv[3]) if len(sys.argv) > 3 else 2
llm = LLM(path, num_threads=threads, speculative_method="none", max_num_seqs=4)
engine = llm.engine
runner = engine.runner
model = runner.model
times: dict[str, list[float]] = defaultdict(list)


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        times[name].append(time.perf_counter() - start)
        return result

    return wrapper


class TimedEmbedding:
    def __init__(self, embed: Any) -> None:
        self.embed, self.table = embed, embed.table

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return timed("embed", self.embed)(ids)  # type: ignore[no-any-return]


assert model.fused is not None, "the fused decoder does not serve this model"
type(model.fused).__call__ = timed("fused stack", type(model.fused).__call__)  # type: ignore[method-assign]
model._logits = timed("final norm + LM head", model._logits)  # type: ignore[method-assign]
model.embed = TimedEmbedding(model.embed)  # type: ignore[assignment]
model.forward = timed("model.forward", model.forward)  # type: ignore[method-assign]
runner.prepare = timed("runner.prepare", runner.prepare)  # type: ignore[method-assign]
runner.sampler = timed("sampler", runner.sampler)  # type: ignore[assignment]
runner.execute_model = timed("runner.execute_model", runner.execute_model)  # type: ignore[method-assign]
engine.scheduler.schedule = timed("scheduler.schedule", engine.scheduler.schedule)  # type: ignore[method-assign]
engine.scheduler.update_from_output = timed("scheduler.update", engine.scheduler.update_from_output)  # type: ignore[method-assign]
engine.step = timed("engine.step", engine.step)  # type: ignore[method-assign]

random.seed(0)
prompt = [random.randrange(1000, 30000) for _ in range(200)]
params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
for _ in range(2):  # the first run warms up
    times.clear()
    llm.generate([prompt], params, use_tqdm=False)
for name, values in times.items():
    decode = sorted(values[1:])  # the first step is the prefill
    print(
        f"{name:24s} min {decode[0] * 1e3:8.3f}  p10 {decode[len(decode) // 10] * 1e3:8.3f}"
        f"  median {statistics.median(decode) * 1e3:8.3f} ms"
    )

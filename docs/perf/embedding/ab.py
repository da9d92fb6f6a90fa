"""The embedding model's forward, two trees' stoker/models/embedding.py in one
process, called in turn (best of 5 each): python ab.py BEFORE_TREE AFTER_TREE.
Both on one thread (torch.set_num_threads(1) as the torch front end did)."""
import importlib.util, sys, time, random
def load(tree, name):
    spec = importlib.util.spec_from_file_location(name, f"{tree}/stoker/models/embedding.py")
    mod = importlib.util.module_from_spec(spec); sys.modules[name] = mod; spec.loader.exec_module(mod); return mod
before = load(sys.argv[1], "emb_before"); after = load(sys.argv[2], "emb_after")
import torch; torch.set_num_threads(1)
path = after.bundled_model_path()
mb, ma = before.EmbeddingModel(path), after.EmbeddingModel(path)
random.seed(0)
words = open(f"{sys.argv[2]}/README.md").read().split()
def text(n): i = random.randrange(len(words) - n); return " ".join(words[i:i+n])
for label, batch in (("1 x 12 words", [text(12)]), ("32 x 40 words", [text(40) for _ in range(32)]), ("8 x 180 words", [text(180) for _ in range(8)])):
    ids = [ma.encode_text(t)[:256] for t in batch]
    res: dict[str, list[float]] = {"before": [], "after": []}
    for _ in range(5):
        for name, m in (("before", mb), ("after", ma)):
            t = time.perf_counter(); m.forward(ids); res[name].append(time.perf_counter() - t)
    ref = mb.forward(ids)
    ref = ref.numpy() if hasattr(ref, "numpy") else ref
    diff = float(abs(ref - ma.forward(ids)).max())
    print(f"{label:>14} ({sum(map(len, ids))} tokens): before {min(res['before'])*1e3:7.1f} ms  after {min(res['after'])*1e3:7.1f} ms  max |diff| {diff:.1e}")

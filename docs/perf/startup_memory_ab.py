"""Start to ready and resident memory, two or more trees alternating (issue 41).

    python docs/perf/startup_memory_ab.py RUNG.gguf ROUNDS TREE_A TREE_B ...

Each round starts `stoker serve` from each tree in turn (PYTHONPATH=TREE, the
ladder's flags), times launch -> first 200 on /ready, reads VmRSS/RssAnon/RssFile
of the server and each child one second later, sends one greedy 16-token
completion (its text must be the same for every tree) and times a 64-token one.
Trees alternate order every round, so a busy machine slows both alike."""
from __future__ import annotations
import json, os, socket, subprocess, sys, time, urllib.request
from pathlib import Path

def free_port() -> int:
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

def tree(root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for n in os.listdir("/proc"):
        if n.isdigit():
            try:
                st = open(f"/proc/{n}/stat").read()
            except OSError:
                continue
            kids.setdefault(int(st[st.rindex(")") + 2:].split()[1]), []).append(int(n))
    out, todo = [], [root]
    while todo:
        p = todo.pop(0); out.append(p); todo += sorted(kids.get(p, []))
    return out

def mem(pid: int) -> dict[str, int]:
    d = {}
    for line in open(f"/proc/{pid}/status"):
        k, _, v = line.partition(":")
        if k in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            d[k] = int(v.split()[0]) // 1024
    d["cmd"] = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()[-60:]
    return d

def run(tree_dir: str, gguf: str, work: Path, extra_env: dict[str, str]) -> dict:
    port = free_port()
    argv = [sys.executable, "-m", "stoker.cli", "serve", "--model", gguf, "--host", "127.0.0.1", "--port", str(port),
            "--no-embedding-model", "--max-num-seqs", "16", "--max-model-len", "2056", "--kv-cache-tokens", "6912",
            "--num-threads", "2"]
    env = {**os.environ, "PYTHONPATH": tree_dir, "STOKER_DB": str(work / "stoker.db"), **extra_env}
    log = open(work / f"{Path(tree_dir).name}.log", "wb")
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=tree_dir, env=env, stdout=log, stderr=subprocess.STDOUT)
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as r:
                if r.status == 200:
                    break
        except Exception:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{tree_dir} exited {proc.returncode}")
        time.sleep(0.05)
    ready = time.perf_counter() - t0
    time.sleep(1.0)
    per = [mem(p) for p in tree(proc.pid)]
    # one greedy request: the output to compare, and RSS after it
    models = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models"))
    body = json.dumps({"model": models["data"][0]["id"], "prompt": "Hello world, this is", "max_tokens": 16, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    out = json.load(urllib.request.urlopen(req, timeout=120))
    after = [mem(p) for p in tree(proc.pid)]
    body64 = json.dumps({"model": models["data"][0]["id"], "prompt": "Once upon a time", "max_tokens": 64, "temperature": 0, "ignore_eos": True}).encode()
    t1 = time.perf_counter()
    json.load(urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body64, {"Content-Type": "application/json"}), timeout=300))
    decode_s = time.perf_counter() - t1
    proc.terminate(); proc.wait(30)
    return {"ready_s": ready, "rss": sum(p["VmRSS"] for p in per), "rss_after_req": sum(p["VmRSS"] for p in after),
            "per": per, "text": out["choices"][0]["text"], "decode_s": decode_s}

if __name__ == "__main__":
    gguf, rounds, trees = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    import tempfile
    work = Path(tempfile.mkdtemp(prefix="startup-memory-ab."))
    res: dict[str, list] = {t: [] for t in trees}
    for r in range(rounds):
        for t in (trees if r % 2 == 0 else trees[::-1]):
            x = run(t, gguf, work, {})
            res[t].append(x)
            print(f"round {r} {t}: ready {x['ready_s']:.2f}s 64tok {x['decode_s']:.2f}s rss {x['rss']} MB (after req {x['rss_after_req']}) "
                  + " | ".join(f"{p['cmd'][-25:]!s}: rss {p['VmRSS']} anon {p['RssAnon']} file {p['RssFile']}" for p in x['per']),
                  flush=True)
    import statistics
    for t in trees:
        print(t, "median ready", round(statistics.median(x["ready_s"] for x in res[t]), 2),
              "median rss", statistics.median(x["rss"] for x in res[t]), "median 64tok", round(statistics.median(x["decode_s"] for x in res[t]), 2), "text", repr(res[t][0]["text"]))
    texts = {t: {x["text"] for x in res[t]} for t in trees}
    print("greedy same:", len(set().union(*texts.values())) == 1)

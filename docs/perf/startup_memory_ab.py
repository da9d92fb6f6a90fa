"""Start to ready and resident memory, two or more trees alternating (issue 41).

    python docs/perf/startup_memory_ab.py RUNG.gguf ROUNDS TREE_A TREE_B ...

Each round starts `stoker serve` from each tree in turn (PYTHONPATH=TREE, the
ladder's flags), times launch -> first 200 on /ready, reads VmRSS/RssAnon/RssFile
of the server and each child one second later, sends one greedy 16-token
completion (its text must be the same for every tree) and times a 64-token one.
Trees alternate order every round, so a busy machine slows both alike. The
measuring itself (ports, the wait for /ready, the process tree and its memory)
is the benches' own, from the tree this script runs in."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from stoker.bench.prefix_restart import free_port
from stoker.bench.server_ready import wait_until_ready
from stoker.bench.soak import cmdline_of, memory_of, process_tree

MIB = 2**20


def mem(pid: int) -> dict[str, Any]:
    m = memory_of(pid) or {"rss": 0, "anon": 0, "file": 0}
    return {"rss": m["rss"] // MIB, "anon": m["anon"] // MIB, "file": m["file"] // MIB, "cmd": cmdline_of(pid)[-60:]}


def run(tree_dir: str, gguf: str, work: Path) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "stoker.cli", "serve", "--model", gguf, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--no-embedding-model", "--max-num-seqs", "16", "--max-model-len", "2056", "--kv-cache-tokens", "6912"]
    argv += ["--num-threads", "2"]
    env = {**os.environ, "PYTHONPATH": tree_dir, "STOKER_DB": str(work / "stoker.db")}
    with open(work / f"{Path(tree_dir).name}.log", "wb") as log:
        started = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=tree_dir, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            if (why := wait_until_ready(url, proc, timeout=900, interval=0.05)) is not None:
                raise RuntimeError(f"{tree_dir}: {why}")
            ready = time.perf_counter() - started
            time.sleep(1.0)
            per = [mem(p) for p in process_tree(proc.pid)]
            model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            # one greedy request: the output to compare, and RSS after it
            first = {"model": model, "prompt": "Hello world, this is", "max_tokens": 16, "temperature": 0}
            out = httpx.post(f"{url}/v1/completions", json=first, timeout=120).json()
            after = [mem(p) for p in process_tree(proc.pid)]
            longer = {"model": model, "prompt": "Once upon a time", "max_tokens": 64, "temperature": 0}
            t1 = time.perf_counter()
            httpx.post(f"{url}/v1/completions", json={**longer, "ignore_eos": True}, timeout=300).raise_for_status()
            decode_s = time.perf_counter() - t1
        finally:
            proc.terminate()
            proc.wait(30)
    return {
        "ready_s": ready,
        "rss": sum(p["rss"] for p in per),
        "rss_after_req": sum(p["rss"] for p in after),
        "per": per,
        "text": out["choices"][0]["text"],
        "decode_s": decode_s,
    }


def main() -> None:
    gguf, rounds, trees = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    work = Path(tempfile.mkdtemp(prefix="startup-memory-ab."))
    results: dict[str, list[dict[str, Any]]] = {t: [] for t in trees}
    for r in range(rounds):
        for t in trees if r % 2 == 0 else trees[::-1]:
            x = run(t, gguf, work)
            results[t].append(x)
            parts = " | ".join(f"{p['cmd'][-25:]}: rss {p['rss']} anon {p['anon']} file {p['file']}" for p in x["per"])
            print(
                f"round {r} {t}: ready {x['ready_s']:.2f}s 64tok {x['decode_s']:.2f}s rss {x['rss']} MB"
                f" (after req {x['rss_after_req']}) {parts}",
                flush=True,
            )
    for t in trees:
        xs = results[t]
        print(
            t,
            "median ready",
            round(statistics.median(x["ready_s"] for x in xs), 2),
            "median rss",
            statistics.median(x["rss"] for x in xs),
            "median 64tok",
            round(statistics.median(x["decode_s"] for x in xs), 2),
            "text",
            repr(xs[0]["text"]),
        )
    texts = {t: {x["text"] for x in results[t]} for t in trees}
    print("greedy same:", len(set().union(*texts.values())) == 1)


if __name__ == "__main__":
    main()

"""TTFT of a request with a ~4,000-token prefix: (a) new, (b) in RAM, (c) on disk after a server restart.

python docs/perf/kv_disk_ttft.py [rounds] [extra `stoker serve` flags...]

Starts `stoker serve --kv-cache-disk DIR` (the default model unless a --model is given) on
127.0.0.1, sends each of `rounds` distinct prefixes twice (a, b) with the official openai client
(streamed completions, greedy, 4 tokens), stops the server (SIGTERM), starts it again on the same
DIR and sends each once more (c). Before each phase it waits for the engine's one-off idle-time
calibration (speculative decoding's step costs), which a request arriving meanwhile would wait
for whatever the cache holds. Prints each request's TTFT, cached_tokens and text (which must be
the same in a, b and c), the medians, and the disk tier's metrics.
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from conftest import ServerProcess, start_server

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
EXTRA = sys.argv[2:]
WORDS = ["river", "stone", "lantern", "copper", "meadow", "orbit", "violet", "harbor", "signal", "ember"]


def prefix(seed: int) -> str:
    """~4,000 tokens of the default model's tokenizer (1,000 'word+number' pairs)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) + str(rng.randint(0, 999)) for _ in range(1000))


def settle(server: ServerProcess) -> None:
    deadline = time.monotonic() + 180
    while "step ms by rows" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.5)


def ttft(client: openai.OpenAI, model: str, text: str) -> tuple[float, int, str]:
    started = time.perf_counter()
    first = None
    out = ""
    cached = -1
    stream = client.completions.create(
        model=model,
        prompt=text,
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            first = first or time.perf_counter() - started
            out += chunk.choices[0].text
        if chunk.usage and chunk.usage.prompt_tokens_details:
            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
    assert first is not None
    return first, cached, out


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="kv-disk-ttft-"))
    disk = work / "kv"
    disk.mkdir()
    args = ["--kv-cache-disk", str(disk), "--no-embedding-model", *EXTRA]
    texts = [prefix(seed) for seed in range(1, ROUNDS + 1)]
    rows: dict[str, list[tuple[float, int, str]]] = {"a_new": [], "b_ram": [], "c_disk": []}
    for phase in ("first", "restarted"):
        server = start_server(args, str(work), ready_timeout=600)
        try:
            settle(server)
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
            model = client.models.list().data[0].id
            for text in texts:
                if phase == "first":
                    rows["a_new"].append(ttft(client, model, text))
                    rows["b_ram"].append(ttft(client, model, text))
                else:
                    rows["c_disk"].append(ttft(client, model, text))
            time.sleep(2)  # one stats interval, so /metrics has the last request
            metrics = httpx.get(server.url + "/metrics").text
        finally:
            server.stop()
    for i in range(ROUNDS):
        print(f"prefix {i + 1}:")
        for name, results in rows.items():
            seconds, cached, out = results[i]
            print(f"  {name:7s} TTFT {seconds * 1000:9.1f} ms  cached_tokens={cached:5d}  text={out!r}")
    medians = {name: statistics.median(r[0] for r in results) for name, results in rows.items()}
    print("median ms: " + ", ".join(f"{name} {value * 1000:.1f}" for name, value in medians.items()))
    print(f"a/c = {medians['a_new'] / medians['c_disk']:.1f}x, a/b = {medians['a_new'] / medians['b_ram']:.1f}x")
    same = all(rows["a_new"][i][2] == rows["b_ram"][i][2] == rows["c_disk"][i][2] for i in range(ROUNDS))
    print(f"same text cold, from RAM and from disk: {same}")
    for line in metrics.splitlines():
        if line.startswith("stoker:kv_disk") and "_created" not in line:
            print(line)


if __name__ == "__main__":
    main()

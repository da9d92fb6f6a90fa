"""Hot swap (or canary) under load against a running `stoker serve`: N clients
stream chat completions from MODEL in a loop while one admin call loads PATH
as MODEL's new version; prints how many streams ran, failed or were cut, and
which versions answered before and after.

    python docs/perf/fleet/swap_under_load.py --url http://127.0.0.1:8000 --model smol --path /m/v2.gguf
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter

import httpx


async def stream(client: httpx.AsyncClient, url: str, model: str, max_tokens: int) -> tuple[str, str]:
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me about the sea."}]}
    body |= {"max_tokens": max_tokens, "stream": True}
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return "failed", f"http {response.status_code}"
            done = False
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: ") and '"error"' in line:
                    return "failed", json.loads(line[6:])["error"]["message"]
            return ("ok" if done else "cut"), response.headers.get("x-stoker-model-version", "?")
    except httpx.HTTPError as exc:
        return "failed", repr(exc)


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True)
    p.add_argument("--path", required=True)
    p.add_argument("--canary-percent", type=float, default=None)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--after", type=float, default=10.0, help="seconds of load after the swap answered")
    args = p.parse_args()
    results: list[tuple[float, str, str]] = []
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=600) as client:

        async def worker() -> None:
            while not stop.is_set():
                outcome, detail = await stream(client, args.url, args.model, args.max_tokens)
                results.append((time.monotonic(), outcome, detail))

        workers = [asyncio.create_task(worker()) for _ in range(args.clients)]
        await asyncio.sleep(3)
        started = time.monotonic()
        body = {"name": args.model, "path": args.path}
        if args.canary_percent is not None:
            body["canary_percent"] = args.canary_percent
        swap = await client.post(f"{args.url}/admin/models", json=body)
        swapped = time.monotonic()
        await asyncio.sleep(args.after)
        stop.set()
        await asyncio.gather(*workers)
    outcomes = Counter(o for _, o, _ in results)
    before = Counter(d for t, o, d in results if o == "ok" and t < started)
    after = Counter(d for t, o, d in results if o == "ok" and t > swapped + 2)
    print(f"swap: HTTP {swap.status_code} in {swapped - started:.1f} s: {swap.text[:200]}")
    print(f"streams: {len(results)} ({dict(outcomes)}); versions before: {dict(before)}, 2 s after: {dict(after)}")
    for _, outcome, detail in results:
        if outcome != "ok":
            print(f"  {outcome}: {detail}")


if __name__ == "__main__":
    asyncio.run(main())

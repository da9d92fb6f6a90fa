"""`stoker bench rerank`: reranking throughput of running servers.

--concurrency clients (16 by default) each send POST /v1/rerank (one query,
--documents synthetic documents of --document-words words) as soon as their
last one is answered, until --requests requests have been answered; then the
next server. Servers (--url, repeatable) alternate for --repeats rounds, so
a machine busy with other work in one moment weighs on all of them alike.
Reported per server: requests/s, documents/s, latency p50/p99, errors.

--reference FOLDER adds the baseline for the same kind of pairs: transformers'
AutoModelForSequenceClassification over that folder in this process, in
batches of --reference-batch pairs on --reference-threads torch threads
(1 matches the server's one BLAS thread for front-end models), timed after
each round so that it shares the machine's moments with the servers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from stoker.bench.stats import percentiles
from stoker.cli_keys import add_key_options, api_key_of

WORDS = [
    *("the", "harbour", "town", "river", "market", "bridge", "winter", "summer", "stone", "light", "north"),
    *("south", "road", "field", "garden", "house", "school", "music", "paper", "window", "forest", "island"),
    *("story", "water", "engine", "station", "morning", "evening", "letter", "table", "city", "capital"),
    *("ranking", "search", "query", "answer", "model", "server", "document", "relevance", "reader", "language"),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("servers")
    g.add_argument("--url", action="append", default=[], help="a running server's base URL (repeatable)")
    g.add_argument("--model", default=None, help="reranker to name (default: the server's first reranker)")
    add_key_options(g, ("STOKER_API_KEY", "OPENAI_API_KEY"))
    w = p.add_argument_group("workload")
    w.add_argument("--concurrency", type=int, default=16, help="clients sending at once")
    w.add_argument("--requests", type=int, default=160, help="requests answered per server and round")
    w.add_argument("--documents", type=int, default=20, help="documents per request")
    w.add_argument("--document-words", type=int, default=60, help="words per document")
    w.add_argument("--query-words", type=int, default=8, help="words per query")
    w.add_argument("--repeats", type=int, default=2, help="rounds; servers alternate within each")
    w.add_argument("--seed", type=int, default=0, help="seed of the synthetic texts")
    r = p.add_argument_group("baseline")
    r.add_argument("--reference", default=None, help="cross-encoder folder to time with transformers in-process")
    r.add_argument("--reference-batch", type=int, default=32, help="pairs per transformers forward")
    r.add_argument("--reference-threads", type=int, default=1, help="torch threads for the reference")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


@dataclass
class RoundResult:
    url: str
    seconds: float
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def texts(count: int, words: int, rng: random.Random) -> list[str]:
    return [" ".join(rng.choices(WORDS, k=words)) for _ in range(count)]


async def one_round(args: argparse.Namespace, url: str, key: str | None, rng: random.Random) -> RoundResult:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    bodies = [
        {
            "query": texts(1, args.query_words, rng)[0],
            "documents": texts(args.documents, args.document_words, rng),
            "truncate": True,
            **({"model": args.model} if args.model else {}),
        }
        for _ in range(args.requests)
    ]
    result = RoundResult(url, 0.0)
    queue = iter(bodies)
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300, limits=limits) as client:

        async def worker() -> None:
            for body in queue:
                sent = time.perf_counter()
                reply = await client.post("/v1/rerank", json=body)
                if reply.status_code == 200:
                    result.latencies.append(time.perf_counter() - sent)
                else:
                    result.errors.append(f"{reply.status_code}: {reply.text[:200]}")

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        result.seconds = time.perf_counter() - started
    return result


class Reference:
    """The same kind of pairs through transformers in this process, timed between the servers' rounds."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import transformers

        torch.set_num_threads(args.reference_threads)
        self.args = args
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(args.reference)
        self.model = transformers.AutoModelForSequenceClassification.from_pretrained(args.reference).eval()

    def docs_per_second(self, rng: random.Random) -> float:
        import torch

        args = self.args
        count = max(args.reference_batch, min(args.requests * args.documents, 320))
        query = texts(1, args.query_words, rng)[0]
        documents = texts(count, args.document_words, rng)
        started = time.perf_counter()
        with torch.no_grad():
            for i in range(0, count, args.reference_batch):
                batch = documents[i : i + args.reference_batch]
                encoded = self.tokenizer(
                    [query] * len(batch), batch, padding=True, truncation=True, return_tensors="pt"
                )
                torch.sigmoid(self.model(**encoded).logits[:, 0])
        return float(count / (time.perf_counter() - started))


def summarize(args: argparse.Namespace, rounds: list[RoundResult]) -> dict[str, Any]:
    by_url: dict[str, Any] = {}
    for url in args.url:
        mine = [r for r in rounds if r.url == url]
        seconds = sum(r.seconds for r in mine)
        latencies = [x for r in mine for x in r.latencies]
        answered = len(latencies)
        by_url[url] = {
            "requests": answered,
            "errors": sum(len(r.errors) for r in mine),
            "first_error": next((e for r in mine for e in r.errors), None),
            "req_s": answered / seconds if seconds else None,
            "docs_s": answered * args.documents / seconds if seconds else None,
            "latency_s": percentiles(latencies, (50, 99)),
        }
    return by_url


async def main(args: argparse.Namespace) -> int:
    if not args.url:
        print("stoker bench rerank: give at least one --url")
        return 2
    key = api_key_of(args)
    rng = random.Random(args.seed)
    rounds = []
    reference = Reference(args) if args.reference else None
    reference_rates: list[float] = []
    for repeat in range(args.repeats):
        for url in args.url:
            result = await one_round(args, url, key, rng)
            rounds.append(result)
            if not args.json:
                print(f"round {repeat + 1} {url}: {len(result.latencies)} answered in {result.seconds:.2f} s")
        if reference is not None:
            reference_rates.append(reference.docs_per_second(rng))
            if not args.json:
                print(f"round {repeat + 1} transformers: {reference_rates[-1]:.1f} docs/s")
    report: dict[str, Any] = {
        "concurrency": args.concurrency,
        "documents": args.documents,
        "document_words": args.document_words,
        "servers": summarize(args, rounds),
    }
    if reference_rates:
        report["reference_transformers_docs_s"] = sum(reference_rates) / len(reference_rates)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for url, s in report["servers"].items():
        lat = s["latency_s"]
        if not s["requests"]:
            print(f"{url}: nothing answered; errors {s['errors']} (first: {s['first_error']})")
            continue
        print(
            f"{url}: {s['req_s']:.2f} req/s, {s['docs_s']:.1f} docs/s, p50 {lat['p50'] * 1e3:.0f} ms, "
            f"p99 {lat['p99'] * 1e3:.0f} ms, errors {s['errors']}"
            + (f" (first: {s['first_error']})" if s["first_error"] else "")
        )
    if args.reference:
        print(
            f"transformers in-process ({args.reference_threads} thread(s), batch {args.reference_batch}): "
            f"{report['reference_transformers_docs_s']:.1f} docs/s"
        )
    return 0


def run(args: argparse.Namespace) -> int:
    return asyncio.run(main(args))

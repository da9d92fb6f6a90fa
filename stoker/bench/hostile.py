"""`stoker bench hostile`: does one client's request slow everyone else's tokens?

One unrelated streaming request (the victim: greedy, ignore_eos, a fixed
prompt) is timed alone, then while a hostile request runs beside it, case by
case, and its inter-token latency (ITL) compared:

- stop:    the most stop strings and stop_token_ids allowed, the strings as long
           as allowed and built so that the output keeps matching their
           prefixes (a one-token logit_bias forces the output to repeat "A");
- bias:    a logit_bias with as many entries as allowed (the whole vocabulary
           where the server takes it) and n=64 (--bias-n);
- fffd:    a logit_bias that forces UTF-8 continuation bytes, so the text never
           completes a character and ends in U+FFFD at every step;
- grammar: a big JSON schema (--grammar-fields properties), a fresh one for
           every hostile request, so every one compiles.

The hostile request is re-sent as soon as it ends, for as long as the victim
runs. The victim is also timed beside the hostile request's benign twin: the
same n, max_tokens and forced output without the long lists or the grammar,
so that hostile/benign is what the lists cost the others (a batch of 64 more
sequences slows every step on its own, whatever they ask for). A server that refuses it (a 400 from request bounds, say) is reported
with its message, and the ratio then only shows that nothing ran beside the
victim. Servers are given by --url, or started here from source trees
(--tree DIR, repeatable: `python -m stoker.cli serve` with DIR on PYTHONPATH),
so a base commit and the working tree can be compared in one run, cases
alternating between them. Target: every ratio at most 1.2x.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from stoker.bench.server_ready import wait_until_ready
from stoker.cli_keys import add_key_options, api_key_of

CASES = ("stop", "bias", "fffd", "grammar")
VICTIM_PROMPT = "The history of the old harbour town begins with"


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("servers")
    g.add_argument("--url", action="append", default=[], help="a running server's base URL (repeatable)")
    g.add_argument(
        "--tree",
        action="append",
        default=[],
        help="start a server from this source tree (repeatable; e.g. a `git worktree` of a base commit)",
    )
    g.add_argument(
        "--serve-args",
        default="--max-num-seqs 128",
        help="arguments for the servers --tree starts (the default leaves the victim a slot beside n=64)",
    )
    g.add_argument("--model", default=None, help="model name to send; default: the first one each server lists")
    g.add_argument("--tokenizer", default=None, help="the served model's file or folder (default: stoker's default)")
    add_key_options(g, ("STOKER_API_KEY", "OPENAI_API_KEY"))
    w = p.add_argument_group("workload")
    w.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    w.add_argument("--victim-tokens", type=int, default=96, help="tokens the timed request generates")
    w.add_argument("--repeats", type=int, default=3, help="victim runs per case (alone and during), pooled")
    w.add_argument("--max-stop", type=int, default=64, help="stop strings the hostile request sends")
    w.add_argument("--max-stop-chars", type=int, default=1024, help="characters per stop string")
    w.add_argument("--max-stop-ids", type=int, default=256, help="stop_token_ids entries")
    w.add_argument(
        "--max-bias", type=int, default=300, help="logit_bias entries for the bias case (0: the whole vocabulary)"
    )
    w.add_argument("--bias-n", type=int, default=64, help="n of the bias case")
    w.add_argument("--grammar-fields", type=int, default=200, help="properties of the grammar case's schema")
    w.add_argument("--hostile-tokens", type=int, default=2048, help="max_tokens of the stop and fffd cases' requests")
    w.add_argument(
        "--lead-s",
        type=float,
        default=12.0,
        help="seconds the stop and fffd cases' request runs before the victim starts (its cost grows with its output)",
    )
    w.add_argument("--bias-tokens", type=int, default=64, help="max_tokens of the bias case's (n of them)")
    w.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    w.add_argument("--out", default=None, help="write every measurement as JSON here")


@dataclass
class Stream:
    status: int = 0
    error: str | None = None
    itls: list[float] = field(default_factory=list)
    tokens: int = 0
    times: list[float] = field(default_factory=list)
    """perf_counter() at each chunk with text."""


async def stream(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    headers: dict[str, str],
    out: Stream | None = None,
) -> Stream:
    """One streamed completion; the gaps between content chunks are its ITLs.
    Never raises (but may be cancelled: `out` then holds what came so far)."""
    out = out if out is not None else Stream()
    last: float | None = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=payload, headers=headers) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                try:
                    out.error = str(json.loads(body)["error"]["message"])[:300]
                except (ValueError, KeyError, TypeError):
                    out.error = body[:300]
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                obj = json.loads(line[5:])
                if obj.get("error"):
                    out.error = json.dumps(obj["error"])[:300]
                    return out
                if any(c.get("text") for c in obj.get("choices") or []):
                    now = time.perf_counter()
                    if last is not None:
                        out.itls.append(now - last)
                    last, out.tokens = now, out.tokens + 1
                    out.times.append(now)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:300]
    return out


def continuation_byte_tokens(hf: Any) -> list[int]:
    """Token ids of the single bytes 0x80-0xBF (UTF-8 continuation bytes), for a
    byte-level BPE (GPT-2's byte alphabet) or a SentencePiece byte-fallback vocabulary."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = dict(zip(visible, visible))
    extra = 0
    for b in range(256):
        if b not in alphabet:
            alphabet[b] = 256 + extra
            extra += 1
    vocab = hf.get_vocab()
    ids = [vocab.get(f"<0x{b:02X}>", vocab.get(chr(alphabet[b]))) for b in range(0x80, 0xC0)]
    return [i for i in ids if i is not None]


class Hostile:
    """The hostile request of each case, built from the tokenizer and the limits to use."""

    def __init__(self, args: argparse.Namespace, hf: Any) -> None:
        self.args = args
        self.vocab = len(hf)
        a_ids = hf.encode("A", add_special_tokens=False)
        self.force_a = {str(a_ids[-1]): 100}
        self.continuation = continuation_byte_tokens(hf)
        self.salt = 0

    def payload(self, case: str, model: str | None, benign: bool = False) -> dict[str, Any]:
        """The case's hostile request; benign: its twin of the same shape (n,
        max_tokens, the forced output) without the long lists or the grammar."""
        a = self.args
        body: dict[str, Any] = {
            "model": model or "default",
            "prompt": "Say something.",
            "max_tokens": a.hostile_tokens,
            "temperature": 1.0,
            "ignore_eos": True,
            "stream": True,
        }
        if case == "stop":
            # The last stop is what the output (forced to "AAAA...") keeps matching a prefix
            # of; the others share all but their first character with it.
            k = a.max_stop_chars
            stops = [chr(0x42 + i % 20) + "A" * (k - 2) + "!" for i in range(a.max_stop - 1)]
            body["logit_bias"] = self.force_a
            if not benign:
                body["stop"] = [*stops, "A" * (k - 1) + "!"]
                body["stop_token_ids"] = list(range(self.vocab - a.max_stop_ids, self.vocab))
        elif case == "bias":
            entries = self.vocab if a.max_bias <= 0 else min(a.max_bias, self.vocab)
            # Spread over the vocabulary, small biases: the text stays ordinary.
            step = max(1, self.vocab // entries)
            body |= {"n": a.bias_n, "max_tokens": a.bias_tokens}
            if not benign:
                body["logit_bias"] = {str(t): 0.5 for t in range(0, self.vocab, step)[:entries]}
        elif case == "fffd":
            if not benign:
                body["logit_bias"] = {str(t): 100 for t in self.continuation[: a.max_bias or None]}
        elif case == "grammar":
            self.salt += 1
            body["max_tokens"] = 16
            if not benign:
                body["response_format"] = _schema_format(a.grammar_fields, self.salt)
        else:
            raise ValueError(f"unknown case {case!r}; choose from {', '.join(CASES)}")
        return body


def _schema_format(fields: int, salt: int) -> dict[str, Any]:
    props: dict[str, Any] = {}
    for i in range(fields):
        name = f"f{salt}_{i}"
        if i % 3 == 0:
            props[name] = {"type": "string", "pattern": r"^[a-z]{1,8}@[a-z]{2,5}\.(com|org|net)$"}
        elif i % 3 == 1:
            props[name] = {"enum": [f"v{i}_{j}" for j in range(20)]}
        else:
            props[name] = {"type": "integer", "minimum": 0, "maximum": 10**6}
    schema = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    return {"type": "json_schema", "json_schema": {"name": f"big{salt}", "schema": schema}}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure_case(
    client: httpx.AsyncClient, url: str, model: str | None, case: str, hostile: Hostile, args: argparse.Namespace
) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    victim = {
        "model": model or "default",
        "prompt": VICTIM_PROMPT,
        "max_tokens": args.victim_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    itls: dict[str, list[float]] = {"alone": [], "benign": [], "hostile": []}
    hostile_status: dict[str, int] = {}
    errors: list[str] = []
    for _ in range(args.repeats):
        base = await stream(client, url, victim, headers)
        if base.error:
            raise RuntimeError(f"{url}: the victim request failed: {base.error}")
        itls["alone"] += base.itls
        for kind in ("benign", "hostile"):
            make = functools.partial(hostile.payload, case, model, kind == "benign")
            lead = args.lead_s if case in ("stop", "fffd") else 0.0
            run = await _beside(client, url, victim, headers, make, lead)
            if kind == "hostile":
                for key, count in run.statuses.items():
                    hostile_status[key] = hostile_status.get(key, 0) + count
            errors += [f"{kind}: {e}" for e in run.errors if f"{kind}: {e}" not in errors]
            itls[kind] += run.victim.itls
    row: dict[str, Any] = {"case": case, "hostile_status": hostile_status, "errors": errors}
    for kind, values in itls.items():
        row[f"{kind}_p50_ms"] = _pct(values, 0.5) * 1e3
        row[f"{kind}_p90_ms"] = _pct(values, 0.9) * 1e3
        row[f"{kind}_itls"] = values
    for q in ("p50", "p90"):
        # The hostile request's cost beyond its shape: against its benign twin.
        row[f"ratio_{q}"] = row[f"hostile_{q}_ms"] / row[f"benign_{q}_ms"]
        row[f"ratio_alone_{q}"] = row[f"hostile_{q}_ms"] / row[f"alone_{q}_ms"]
    return row


@dataclass
class _Beside:
    victim: Stream
    statuses: dict[str, int]
    errors: list[str]


async def _beside(
    client: httpx.AsyncClient,
    url: str,
    victim: dict[str, Any],
    headers: dict[str, str],
    make: Callable[[], dict[str, Any]],
    lead_s: float = 0.0,
) -> _Beside:
    """The victim timed while make()'s request runs beside it, re-sent as it ends."""
    stop = asyncio.Event()
    statuses: dict[str, int] = {}
    errors: list[str] = []

    async def attack() -> None:
        while not stop.is_set():
            res = Stream()
            task = asyncio.create_task(stream(client, url, make(), headers, res))
            try:
                await task
            finally:  # also when cancelled: what the server answered is known by then
                if res.status:
                    statuses[str(res.status)] = statuses.get(str(res.status), 0) + 1
                if res.error and res.error not in errors:
                    errors.append(res.error)
            if res.status >= 400:
                return  # refused: nothing runs beside the victim

    timed = Stream()
    if lead_s > 0:
        # What the request costs grows with its output (a held stop-string prefix, an
        # undecoded window): the victim starts once the hostile request is well into it.
        attacker = asyncio.create_task(attack())
        await asyncio.sleep(lead_s)
        attack_start = time.perf_counter()
        victim_task = asyncio.create_task(stream(client, url, victim, headers, timed))
    else:
        # The victim streams first and the hostile request starts once its tokens flow,
        # so a stall the hostile request causes on arrival (a compile on the step loop,
        # say) is a gap between two of the victim's tokens, not a slower first token.
        victim_task = asyncio.create_task(stream(client, url, victim, headers, timed))
        while timed.tokens < 2 and not victim_task.done():
            await asyncio.sleep(0.005)
        attack_start = time.perf_counter()
        attacker = asyncio.create_task(attack())
    await victim_task
    stop.set()
    # The request in flight is dropped (the server aborts it): only the victim's time counts.
    attacker.cancel()
    try:
        await attacker
    except asyncio.CancelledError:
        pass
    if timed.error:
        errors.append(f"victim: {timed.error}")
    timed.itls = [b - a for a, b in zip(timed.times, timed.times[1:]) if b > attack_start]
    return _Beside(timed, statuses, errors)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def started_server(tree: str, serve_args: str, log_dir: str) -> Iterator[str]:
    """`stoker serve` from the given source tree on a free loopback port, until the block ends."""
    tree = os.path.abspath(tree)
    port = _free_port()
    log_path = os.path.join(log_dir, f"server-{port}.log")
    env = {**os.environ, "PYTHONPATH": tree, "STOKER_DB": os.path.join(log_dir, f"stoker-{port}.db")}
    cmd = [sys.executable, "-m", "stoker.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*cmd, *serve_args.split()], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tree)
    url = f"http://127.0.0.1:{port}"
    try:
        why = wait_until_ready(url, proc, 900, interval=0.5)
        if why is not None:
            raise RuntimeError(f"the server from {tree} {why}; see {log_path}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def bench(urls: list[tuple[str, str]], args: argparse.Namespace, hostile: Hostile) -> list[dict[str, Any]]:
    """Every case against every server, servers alternating within each case."""
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise ValueError(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    results: list[dict[str, Any]] = []
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:
        models: dict[str, str | None] = {}
        for _label, url in urls:
            models[url] = args.model or await _first_model(client, url, args.api_key)
            # Warm-up: the first requests pay for lazy initialisation.
            headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
            await stream(client, url, {"model": models[url], "prompt": "Hi", "max_tokens": 4}, headers)
            # ... and the first constrained request builds the tokenizer's grammar tables (once
            # per server, seconds): measured here would be that, not what each grammar costs.
            if "grammar" in cases:
                warm = {"model": models[url], "prompt": "Hi", "max_tokens": 4}
                await stream(client, url, warm | {"response_format": {"type": "json_object"}}, headers)
        for case in cases:
            for label, url in urls:
                print(f"  {label}: {case} ...", file=sys.stderr, flush=True)
                row = await measure_case(client, url, models[url], case, hostile, args)
                results.append({"server": label, "url": url, **row})
    return results


async def _first_model(client: httpx.AsyncClient, url: str, api_key: str | None) -> str | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        data = (await client.get(f"{url}/v1/models", headers=headers)).json().get("data") or []
        return str(data[0]["id"]) if data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return None


def table(results: list[dict[str, Any]]) -> str:
    """ITL p50/p90 of the victim alone, beside the benign twin and beside the
    hostile request; the ratio is hostile over benign (the cost of the lists
    or grammar themselves), then hostile over alone."""
    lines = [
        f"{'server':<22} {'case':<8} {'alone ms':>13} {'benign ms':>13} {'hostile ms':>13} "
        f"{'hostile/benign':>15} {'hostile/alone':>14}  hostile request",
    ]
    for r in results:
        status = ", ".join(f"{n}x HTTP {s}" for s, n in sorted(r["hostile_status"].items()))
        refused = [e for e in r["errors"] if e.startswith("hostile:")]
        if refused and "200" not in r["hostile_status"]:
            status += f" ({refused[0].removeprefix('hostile: ')[:100]})"

        def ms(kind: str, r: dict[str, Any] = r) -> str:
            return f"{r[kind + '_p50_ms']:.1f}/{r[kind + '_p90_ms']:.1f}"

        lines.append(
            f"{r['server'][-22:]:<22} {r['case']:<8} {ms('alone'):>13} {ms('benign'):>13} {ms('hostile'):>13} "
            f"{r['ratio_p50']:>6.2f}/{r['ratio_p90']:.2f}x {r['ratio_alone_p50']:>6.2f}/{r['ratio_alone_p90']:.2f}x"
            f"  {status}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from stoker.bench.workload import load_tokenizer

    try:
        args.api_key = api_key_of(args)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if not args.url and not args.tree:
        print("give a server (--url URL) or a source tree to start one from (--tree DIR)", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(args.tokenizer)
    hostile = Hostile(args, getattr(tokenizer, "hf", tokenizer))
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="stoker-hostile-") as log_dir:
        urls = [(url.rstrip("/").removesuffix("/v1"), url.rstrip("/").removesuffix("/v1")) for url in args.url]
        for tree in args.tree:
            print(f"starting a server from {tree} ...", file=sys.stderr, flush=True)
            urls.append((tree, stack.enter_context(started_server(tree, args.serve_args, log_dir))))
        results = asyncio.run(bench(urls, args, hostile))
    print(table(results))
    worst = max((r["ratio_p90"] for r in results if "200" in r["hostile_status"]), default=float("nan"))
    print(f"\nworst hostile/benign p90 ITL ratio (hostile request served): {worst:.2f}x (target <= 1.2x)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "results": results}, f, indent=1)
    return 0

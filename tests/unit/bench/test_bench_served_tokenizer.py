"""What counts `stoker bench serve`'s prompt tokens without --tokenizer: the served
model's tokenizer through the server's /tokenize (stoker's and vLLM's schema,
or llama-server's), else stoker's default model's, with a line saying so."""

from __future__ import annotations

import argparse
import json
import random
import socket
import threading
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from stoker.bench import workload
from stoker.bench.cli import add_serve_arguments, build_workload, choose_tokenizer, serve_main
from stoker.bench.fakeserver import FakeServer
from stoker.bench.serve import make_targets
from stoker.bench.workload import LengthDist, ServedTokenizer


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(argv)


def requested(spec: str, num: int, seed: int = 0) -> list[int]:
    """The lengths synthetic() draws (no shared prefix): its first draw from Random(seed)."""
    return LengthDist.parse(spec).sample(random.Random(seed), num)


def chosen(args: argparse.Namespace, headers: dict[str, str] | None = None) -> tuple[Any, str | None]:
    return choose_tokenizer(args, make_targets([args.url], args.model, args.models)[0], headers or {})


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_prompts_have_the_requested_lengths_as_the_server_counts_them(fake_server, endpoint: str) -> None:
    """stoker serve over the fake core counts a token per byte, far from the default model's tokenizer."""
    args = parse(["--url", fake_server.url, "--num-requests", "8", "--input-len", "20:60", "--endpoint", endpoint])
    tok, note = chosen(args)
    try:
        assert note is None and isinstance(tok, ServedTokenizer)
        assert tok.model == "fake-model" and tok.schema == workload.VLLM
        specs = build_workload(args, tok)(0)
    finally:
        tok.close()
    prompts = [spec.prompt or "" for spec in specs]
    with httpx.Client(base_url=fake_server.url, timeout=30) as client:
        if endpoint == "chat":  # the template's tokens too: the prompt is the requested length as sent
            bodies = [{"messages": [{"role": "user", "content": p}], "add_generation_prompt": True} for p in prompts]
        else:
            bodies = [{"prompt": p, "add_special_tokens": False} for p in prompts]
        counts = [client.post("/tokenize", json=body).json()["count"] for body in bodies]
    assert counts == requested("20:60", 8)


async def test_bench_serve_counts_with_the_served_model_and_says_so(fake_server, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")

    def no_local_tokenizer(model: str | None = None) -> workload.HFTokenizer:
        raise AssertionError("a local tokenizer was loaded")

    monkeypatch.setattr(workload, "load_tokenizer", no_local_tokenizer)
    argv = ["--url", fake_server.url, "--num-requests", "4", "--input-len", "20:40", "--output-len", "2"]
    argv += ["--shared-prefix-len", "16", "--num-prefixes", "2", "--prefix-fill"]  # the fill's prefixes counted alike
    args = parse([*argv, "--ignore-eos", "--warmup", "0", "--no-progress", "--out", str(tmp_path)])
    assert await serve_main(args) == 0
    out = capsys.readouterr().out
    where = f"fake-model's tokenizer through {fake_server.url.removeprefix('http://')}/tokenize"
    assert f"counted with {where}" in out and "default model" not in out
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["tokenizer"] == where
    (run,) = result["runs"]
    assert run["summary"]["failed"] == 0, run["summary"]["failures"]
    # The server's own count (usage; a token per byte, BOS perhaps added): 16 + 20..40 tokens, as asked.
    assert all(36 <= r["prompt_tokens"] <= 57 for r in run["requests"]), run["requests"]


class DefaultStandIn:
    """Stands in for stoker's default model's tokenizer (a token per word), so that falling back is quick."""

    name = "stoker's default model's tokenizer (stand-in)"

    def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join("x" * i for i in ids)


async def test_a_server_without_tokenize_falls_back_with_one_line(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setenv("STOKER_API_KEY", "sk-bench")
    monkeypatch.setattr(workload, "load_tokenizer", lambda model=None: DefaultStandIn())
    async with FakeServer(itl=0.0) as server:  # /tokenize: 404
        args = parse(["--url", server.url, "--num-requests", "3", "--input-len", "5:9", "--no-progress"])
        assert await serve_main(args) == 0
        tried = [q for q in server.requests if q["path"] in ("/tokenize", "/detokenize")]
    assert [q["path"] for q in tried] == ["/tokenize", "/tokenize"]  # each schema once, up front
    assert [q["body"] for q in tried] == [
        {"model": "fake-model", "prompt": workload.PROBE, "add_special_tokens": False},
        {"content": workload.PROBE, "add_special": False},
    ]
    assert all(q["headers"]["authorization"] == "Bearer sk-bench" for q in tried)
    lines = capsys.readouterr().out.splitlines()
    (fallback,) = [line for line in lines if line.startswith("tokens: ")]
    assert "404" in fallback and "counting with stoker's default model's tokenizer (stand-in)" in fallback
    assert "default model's tokens, not the served model's" in fallback and "--tokenizer FILE" in fallback
    (built,) = [line for line in lines if line.startswith("workload: ")]
    assert "3 prompts" in built and "counted with stoker's default model's tokenizer (stand-in)" in built


def test_an_unreachable_server_falls_back(monkeypatch) -> None:
    monkeypatch.setattr(workload, "load_tokenizer", lambda model=None: DefaultStandIn())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening, then closed
    tok, note = chosen(parse(["--url", f"http://127.0.0.1:{port}"]))
    assert isinstance(tok, DefaultStandIn)
    assert note is not None and "cannot reach" in note and "--tokenizer FILE" in note


class WordHF:
    """A Hugging Face tokenizer's encode and decode, a token per word."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(w) for w in text.split()]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join("x" * i for i in ids)


async def test_tokenizer_flag_wins_over_the_server(fake_server, capsys, monkeypatch) -> None:
    from stoker.models import loader

    monkeypatch.setenv("COLUMNS", "200")
    loaded: list[str] = []

    def local(path: str) -> Any:
        loaded.append(path)
        return argparse.Namespace(hf=WordHF())

    monkeypatch.setattr(loader, "load_tokenizer", local)
    argv = ["--url", fake_server.url, "--tokenizer", "/models/some.gguf", "--num-requests", "2", "--input-len", "5"]
    assert await serve_main(parse([*argv, "--output-len", "2", "--warmup", "0", "--no-progress"])) == 0
    assert loaded == ["/models/some.gguf"]
    out = capsys.readouterr().out
    assert "counted with the local tokenizer of /models/some.gguf" in out and "/tokenize" not in out


class LlamaServer:
    """llama-server's tokenizer endpoints and nothing of vLLM's: a token per character
    (its code point + 1000); /tokenize without "content" answers no tokens, as llama-server
    does. `key`: every request needs it as a bearer token (else 401)."""

    TEMPLATE = "<|user|>{}<|end|>\n<|assistant|>"

    def __init__(self, key: str | None = None) -> None:
        self.requests: list[tuple[str, dict[str, Any], str | None]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as llama-server
            disable_nagle_algorithm = True  # else each answer's body waits on the client's delayed ACK

            def log_message(self, *args: object) -> None:
                pass

            def answer(self, status: int, obj: object) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                server.requests.append((self.path, {}, self.headers.get("Authorization")))
                if key and self.headers.get("Authorization") != f"Bearer {key}":
                    return self.answer(401, {"error": {"message": "Invalid API Key", "code": 401}})
                if self.path == "/v1/models":
                    return self.answer(200, {"object": "list", "data": [{"id": "llama-test.gguf"}]})
                self.answer(404, {"error": {"message": "File Not Found", "code": 404}})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                server.requests.append((self.path, body, self.headers.get("Authorization")))
                if key and self.headers.get("Authorization") != f"Bearer {key}":
                    return self.answer(401, {"error": {"message": "Invalid API Key", "code": 401}})
                if self.path == "/tokenize":
                    text = body.get("content", "")
                    return self.answer(200, {"tokens": [ord(c) + 1000 for c in text]})
                if self.path == "/detokenize":
                    return self.answer(200, {"content": "".join(chr(t - 1000) for t in body.get("tokens", []))})
                if self.path == "/apply-template":
                    (message,) = body["messages"]
                    return self.answer(200, {"prompt": LlamaServer.TEMPLATE.format(message["content"])})
                self.answer(404, {"error": {"message": "File Not Found", "code": 404}})

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"

    def __enter__(self) -> LlamaServer:
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def llama_server() -> Iterator[LlamaServer]:
    with LlamaServer() as server:
        yield server


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_llama_server_schema(llama_server: LlamaServer, endpoint: str) -> None:
    argv = ["--url", llama_server.url + "/v1", "--num-requests", "32", "--input-len", "40:200", "--endpoint", endpoint]
    args = parse(argv)
    tok, note = chosen(args, {"Authorization": "Bearer sk-bench"})
    try:
        assert note is None and isinstance(tok, ServedTokenizer) and tok.schema == workload.LLAMA_SERVER
        assert "llama-server" in tok.name
        overhead = len(LlamaServer.TEMPLATE.format("x")) - 1
        assert tok.chat_overhead() == overhead
        llama_server.requests.clear()
        specs = build_workload(args, tok)(0)
    finally:
        tok.close()
    wrap = overhead if endpoint == "chat" else 0
    assert [len(spec.prompt or "") + wrap for spec in specs] == requested("40:200", 32)
    calls = llama_server.requests
    assert {path for path, _, _ in calls} <= {"/tokenize", "/detokenize", "/apply-template"}
    assert len(calls) <= 6 * 32  # a handful per prompt
    assert all(
        body.get("add_special") is False and "prompt" not in body for path, body, _ in calls if path == "/tokenize"
    )
    assert {auth for _, _, auth in calls} == {"Bearer sk-bench"}


def test_llama_server_wanting_a_key_falls_back_naming_it(monkeypatch) -> None:
    monkeypatch.setattr(workload, "load_tokenizer", lambda model=None: DefaultStandIn())
    with LlamaServer(key="sk-right") as server:
        tok, note = chosen(parse(["--url", server.url]))
        assert isinstance(tok, DefaultStandIn)
        assert note is not None and "401: no API key was given" in note and "--api-key-file" in note
        tok, note = chosen(parse(["--url", server.url]), {"Authorization": "Bearer sk-wrong"})
        assert note is not None and "401: the API key was refused" in note
        tok, note = chosen(parse(["--url", server.url]), {"Authorization": "Bearer sk-right"})
        assert note is None and isinstance(tok, ServedTokenizer)
        tok.close()


def test_grounded_passages_take_a_few_counts_each() -> None:
    """Each count may be a call to the server: the passage's length is searched for, not
    re-counted after every sentence, and comes out the same (the fewest sentences reaching it)."""

    class Counted(WordHF):
        calls = 0

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            self.calls += 1
            return super().encode(text)

    tok = Counted()
    lengths = LengthDist.parse("200:1000").sample(random.Random("grounded/3/0"), 16)  # grounded()'s draw
    specs = workload.grounded(tok, 16, LengthDist.parse("200:1000"), None, seed=3)
    assert tok.calls <= 16 * 25  # one count per sentence would be about 16 * 75
    for spec, length in zip(specs, lengths, strict=True):
        passage, ask = (spec.prompt or "").split("\n\n")
        sentences = passage.split(". ")
        shorter = ". ".join(sentences[:-1]) + ".\n\n" + ask
        assert len(tok.encode(spec.prompt or "")) >= length > len(tok.encode(shorter))

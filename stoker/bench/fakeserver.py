"""A tiny OpenAI-compatible streaming server with scripted delays and failures,
for testing the load generator without a model (and for trying `stoker bench
serve` by hand: `python -m stoker.bench.fakeserver --port 8001`).

Bare asyncio, one request per connection, so it starts in milliseconds and
depends on nothing."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any


class FakeServer:
    """Streams `max_tokens` chunks (or `tokens` without it) after `ttft`
    seconds, one every `itl` seconds. `fail` scripts errors:
    "500" / "429" / "503": that HTTP status for every request;
    "alternate": every other request gets 503;
    "midstream": two chunks, then an SSE error event;
    "drop": two chunks, then the connection closes without [DONE].
    `prefix_cache` reports, as usage.prompt_tokens_details.cached_tokens, the
    longest run of words a prompt shares with the start of an earlier one.
    GET /ready answers 200."""

    def __init__(
        self,
        tokens: int = 8,
        ttft: float = 0.02,
        itl: float = 0.005,
        fail: str | None = None,
        model: str = "fake-model",
        max_stream: int = 4096,
        prefix_cache: bool = False,
    ) -> None:
        self.tokens, self.ttft, self.itl, self.fail = tokens, ttft, itl, fail
        self.model, self.max_stream = model, max_stream
        self.prefix_cache = prefix_cache
        self._prompts: list[list[str]] = []
        self.requests: list[dict[str, Any]] = []
        """(path, headers, body) of every request received, for assertions."""
        self._server: asyncio.base_events.Server | None = None
        self.url = ""

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._server = await asyncio.start_server(self._handle, host, port)
        self.url = f"http://{host}:{self._server.sockets[0].getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def __aenter__(self) -> FakeServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
            length = int(headers.get("content-length", "0"))
            raw = await reader.readexactly(length) if length else b"{}"
            try:
                body = json.loads(raw)
            except ValueError:
                # A malformed body gets the scripted failure if there is one, else a 400: never a dropped connection.
                status = int(self.fail) if self.fail in ("500", "429", "503") else 400
                return await self._json(writer, status, {"error": {"message": "malformed JSON body", "code": status}})
            self.requests.append({"method": method, "path": path, "headers": headers, "body": body})
            await self._respond(writer, method, path, body, len(self.requests))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _respond(
        self, w: asyncio.StreamWriter, method: str, path: str, body: dict[str, Any], number: int
    ) -> None:
        if method == "GET" and path.rstrip("/") == "/v1/models":
            return await self._json(w, 200, {"object": "list", "data": [{"id": self.model, "object": "model"}]})
        if method == "GET" and path == "/ready":
            return await self._json(w, 200, {"ready": True})
        if path not in ("/v1/completions", "/v1/chat/completions"):
            return await self._json(w, 404, {"error": {"message": f"no route {path}"}})
        status = self.fail if self.fail in ("500", "429", "503") else None
        if self.fail == "alternate" and number % 2 == 0:
            status = "503"
        if status:
            return await self._json(w, int(status), {"error": {"message": "scripted failure", "code": int(status)}})
        chat = path.endswith("chat/completions")
        n = min(int(body.get("max_tokens") or self.tokens), self.max_stream)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        created = int(time.time())

        async def event(obj: dict[str, Any] | str) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            w.write(f"data: {data}\n\n".encode())
            await w.drain()

        def chunk(text: str | None, finish: str | None = None) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if chat:
                choice["delta"] = {"content": text} if text is not None else {}
            else:
                choice["text"] = text or ""
            return {
                "id": f"req-{number}",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
                "model": self.model,
                "choices": [choice],
            }

        if chat:  # OpenAI opens a chat stream with a role-only delta; it is not a token
            await event(
                {**chunk(None), "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
            )
        await asyncio.sleep(self.ttft)
        for i in range(n):
            if i and self.itl:
                await asyncio.sleep(self.itl)
            if i == 2 and self.fail == "midstream":
                return await event({"error": {"message": "scripted engine failure", "code": 500}})
            if i == 2 and self.fail == "drop":
                return
            await event(chunk(f" t{i}", "length" if i == n - 1 else None))
        if (body.get("stream_options") or {}).get("include_usage"):
            prompt = body.get("prompt") or " ".join(m.get("content", "") for m in body.get("messages", []))
            usage: dict[str, object] = {
                "prompt_tokens": len(str(prompt).split()),
                "completion_tokens": n,
                "total_tokens": len(str(prompt).split()) + n,
            }
            if self.prefix_cache:
                usage["prompt_tokens_details"] = {"cached_tokens": self._cached_words(str(prompt).split())}
            await event({**chunk(None), "choices": [], "usage": usage})
        await event("[DONE]")

    def _cached_words(self, words: list[str]) -> int:
        best = 0
        for earlier in self._prompts:
            shared = next((i for i, (a, b) in enumerate(zip(words, earlier)) if a != b), min(len(words), len(earlier)))
            best = max(best, shared)
        self._prompts.append(words)
        return best

    async def _json(self, w: asyncio.StreamWriter, status: int, obj: dict[str, Any]) -> None:
        data = json.dumps(obj).encode()
        w.write(
            f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            f"Connection: close\r\n\r\n".encode()
            + data
        )
        await w.drain()


def main() -> None:
    parser = argparse.ArgumentParser(description=FakeServer.__doc__)
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--ttft", type=float, default=0.05)
    parser.add_argument("--itl", type=float, default=0.01)
    parser.add_argument("--fail", default=None)
    args = parser.parse_args()

    async def serve() -> None:
        server = FakeServer(ttft=args.ttft, itl=args.itl, fail=args.fail)
        print(await server.start(port=args.port), flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()

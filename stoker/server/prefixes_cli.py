"""`stoker prefixes list|pin|unpin`: pinned prefixes of a running server, through its
/admin/prefixes API (docs/prefix-cache.md). The server needs --kv-cache-disk.

    stoker prefixes pin support-bot --messages-file system.json --url http://127.0.0.1:8000
    stoker prefixes pin manual --text-file manual.txt --model qwen
    stoker prefixes list
    stoker prefixes unpin support-bot

The admin key comes from $STOKER_API_KEY or --api-key-file PATH (never the command
line, where ps shows it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

from stoker.cli_keys import add_key_options, api_key_of


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "prefixes", help="pin, list and unpin prefixes kept in a running server's disk tier", description=__doc__
    )
    parser.add_argument("--url", default=os.environ.get("STOKER_URL", "http://127.0.0.1:8000"), help="server URL")
    parser.add_argument("--model", help="served model (default: the server's first)")
    add_key_options(parser, ("STOKER_API_KEY",))
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for a pin (default 900)")
    parser.add_argument("--json", action="store_true", help="print the server's JSON answer")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    actions.add_parser("list", help="pinned prefixes, with how many of their blocks are on disk")
    pin = actions.add_parser("pin", help="compute a prefix once and keep its KV blocks on disk")
    pin.add_argument("label", help="1-64 letters, digits, '.', '_', '-'; a pin of the same label is replaced")
    source = pin.add_mutually_exclusive_group(required=True)
    source.add_argument("--text-file", metavar="PATH", help="the prefix as text, tokenized as a completion prompt")
    source.add_argument(
        "--messages-file", metavar="PATH", help="a JSON list of chat messages, rendered with the chat template"
    )
    source.add_argument("--token-ids-file", metavar="PATH", help="a JSON list of token ids")
    pin.add_argument(
        "--add-generation-prompt", action="store_true", help="with --messages-file: end with an assistant turn"
    )
    actions.add_parser("unpin", help="unpin (its blocks become ordinary cache entries)").add_argument("label")
    parser.set_defaults(func=run)
    return parser


def _request(args: argparse.Namespace) -> tuple[str, str, dict[str, Any] | None, dict[str, str]]:
    """(method, path, body, query) of the call; ValueError for a file that cannot be read."""
    query = {"model": args.model} if args.model else {}
    if args.action == "list":
        return "GET", "/admin/prefixes", None, query
    if args.action == "unpin":
        return "DELETE", f"/admin/prefixes/{quote(args.label, safe='')}", None, query
    body: dict[str, Any] = {"label": args.label}
    if args.model:
        body["model"] = args.model
    path = args.text_file or args.messages_file or args.token_ids_file
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
        if args.text_file:
            body["prompt"] = text
        else:
            body["messages" if args.messages_file else "token_ids"] = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if args.add_generation_prompt:
        body["add_generation_prompt"] = True
    return "POST", "/admin/prefixes", body, {}


def _print_listing(body: dict[str, Any]) -> None:
    for pin in body.get("data", []):
        print(
            f"{pin['label']:<32} {pin['model']} {pin['version']:<4} {pin['num_tokens']:>7} tokens  "
            f"{pin['blocks_on_disk']}/{pin['num_blocks']} blocks on disk"
        )


def run(args: argparse.Namespace) -> int:
    import httpx

    try:
        api_key = api_key_of(args)
        method, path, body, query = _request(args)
    except ValueError as exc:
        print(f"stoker prefixes: {exc}", file=sys.stderr)
        return 2
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = args.url.rstrip("/") + path
    try:
        response = httpx.request(method, url, json=body, params=query, headers=headers, timeout=args.timeout)
    except httpx.HTTPError as exc:
        print(f"stoker prefixes: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    try:
        answer = response.json()
    except ValueError:
        answer = {"error": {"message": response.text}}
    if response.status_code >= 400:
        message = answer.get("error", {}).get("message", response.text) if isinstance(answer, dict) else response.text
        print(f"stoker prefixes {args.action}: {response.status_code}: {message}", file=sys.stderr)
        return 1
    if args.json or args.action != "list":
        print(json.dumps(answer, indent=2))
    else:
        _print_listing(answer)
    return 0

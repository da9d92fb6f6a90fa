"""`stoker models list|load|unload|promote|rollback|canary|sleep|wake`: manage the models of a
running server through its /admin/models API (docs/models.md).

    stoker models load big /models/qwen-v2.gguf --digest sha256:... --url http://127.0.0.1:8000
    stoker models load big /models/qwen-v3.gguf --canary-percent 10
    stoker models promote big
    stoker models sleep big        # its engine process ends until a request (or `wake`) starts it again

The admin key comes from $STOKER_API_KEY or --api-key-file PATH (never the command
line, where ps shows it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from stoker.cli_keys import add_key_options, api_key_of


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "models", help="list, load, swap, canary and unload models of a running server", description=__doc__
    )
    parser.add_argument("--url", default=os.environ.get("STOKER_URL", "http://127.0.0.1:8000"), help="server URL")
    add_key_options(parser, ("STOKER_API_KEY",))
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for a load (default 900)")
    parser.add_argument("--json", action="store_true", help="print the server's JSON answer")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    actions.add_parser("list", help="models, versions, state, memory")
    load = actions.add_parser("load", help="load a model, or a new version of one (a hot swap)")
    load.add_argument("name")
    load.add_argument("path", help="GGUF file or Hugging Face folder, as the server sees it")
    load.add_argument("--digest", help="sha256:<hex> the files must have")
    load.add_argument("--canary-percent", type=float, help="share of new requests for the new version (canary)")
    load.add_argument("--base", help="load PATH as a LoRA adapter of this served model (docs/lora.md)")
    for action, text in (
        ("unload", "drain and unload a model"),
        ("promote", "the canary becomes the stable version"),
        ("rollback", "drop the canary"),
        ("sleep", "drain a model, then end its engine process until its next request (docs/sleep.md)"),
        ("wake", "start a sleeping model's engine again"),
    ):
        actions.add_parser(action, help=text).add_argument("name")
    canary = actions.add_parser("canary", help="change a canary's share of new requests")
    canary.add_argument("name")
    canary.add_argument("percent", type=float)
    parser.set_defaults(func=run)
    return parser


def _request(args: argparse.Namespace) -> tuple[str, str, dict[str, Any] | None]:
    if args.action == "list":
        return "GET", "/admin/models", None
    if args.action == "load":
        body = {
            "name": args.name,
            "path": args.path,
            "digest": args.digest,
            "canary_percent": args.canary_percent,
            "base": args.base,
        }
        return "POST", "/admin/models", {k: v for k, v in body.items() if v is not None}
    if args.action == "unload":
        return "DELETE", f"/admin/models/{args.name}", None
    if args.action == "canary":
        return "PUT", f"/admin/models/{args.name}/canary", {"percent": args.percent}
    return "POST", f"/admin/models/{args.name}/{args.action}", None


def _print_listing(body: dict[str, Any]) -> None:
    for model in body.get("data", []):
        stable = model["stable"]
        mem = f"{stable['memory_bytes'] / 1e6:.0f} MB" if stable.get("memory_bytes") else "-"
        status = "sleeping" if stable.get("sleeping") else stable["status"]
        line = f"{model['name']:<24} {stable['version']:<4} {status:<9} {mem:>8}  {stable['digest']}"
        print(line + (f"  fallback: {','.join(model['fallbacks'])}" if model.get("fallbacks") else ""))
        canary = model.get("canary")
        if canary:
            print(f"{'':<24} {canary['version']:<4} canary {model['canary_percent']:.0f}%  {canary['digest']}")
        for adapter in model.get("adapters", []):
            print(
                f"  lora {adapter['name']:<18} r{adapter['rank'] or '-':<3} {adapter['status']:<9}  {adapter['digest']}"
            )
    for version in body.get("retiring", []):
        print(
            f"{version['name']:<24} {version['version']:<4} {version['status']:<9} (in flight: {version['in_flight']})"
        )


def run(args: argparse.Namespace) -> int:
    import httpx

    method, path, body = _request(args)
    try:
        api_key = api_key_of(args)
    except ValueError as exc:
        print(f"stoker models: {exc}", file=sys.stderr)
        return 2
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.request(method, args.url.rstrip("/") + path, json=body, headers=headers, timeout=args.timeout)
    except httpx.HTTPError as exc:
        print(f"stoker models: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    try:
        answer = response.json()
    except ValueError:
        answer = {"error": {"message": response.text}}
    if response.status_code >= 400:
        message = answer.get("error", {}).get("message", response.text) if isinstance(answer, dict) else response.text
        print(f"stoker models {args.action}: {response.status_code}: {message}", file=sys.stderr)
        return 1
    if args.json or args.action != "list":
        print(json.dumps(answer, indent=2))
    else:
        _print_listing(answer)
    return 0

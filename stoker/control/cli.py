"""`stoker keys create|list|revoke|show`: manage API keys in the database
the server uses (--db, default $STOKER_DB or ~/.stoker/stoker.db).

A running server sees new and revoked keys within a few seconds (its key
cache lifetime); no restart needed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stoker.control.keys import KeyStore

from stoker.control.db import default_db_url
from stoker.control.keys import SCOPES


def parse_expiry(text: str, now: float | None = None) -> float:
    """ISO date (valid through that day, UTC), ISO datetime, or a duration like 30d / 12h / 90m."""
    now = now if now is not None else time.time()
    match = re.fullmatch(r"(\d+)\s*([dhm])", text.strip())
    if match:
        amount, unit = int(match.group(1)), match.group(2)
        return now + amount * {"d": 86400, "h": 3600, "m": 60}[unit]
    try:
        if re.fullmatch(r"\d{4}-\d{2}-\d{2}", text.strip()):
            day = dt.date.fromisoformat(text.strip())
            return dt.datetime(day.year, day.month, day.day, tzinfo=dt.timezone.utc).timestamp() + 86400
        moment = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--expires: expected YYYY-MM-DD, an ISO datetime or a duration like 30d, got {text!r}"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.timezone.utc)
    return moment.timestamp()


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _limits(k: dict[str, Any]) -> str:
    parts = [f"{name}={k[name]}" for name in ("rpm", "tpm", "max_concurrent") if k[name] is not None]
    if k["budget_tokens"] is not None:
        parts.append(f"budget={k['budget_tokens']}/{k['budget_period']}")
    return " ".join(parts) or "unlimited"


def _open(args: argparse.Namespace) -> KeyStore:
    from stoker.control.db import open_db
    from stoker.control.keys import KeyStore
    from stoker.errors import StartupRefused

    try:
        return KeyStore(open_db(args.db))
    except StartupRefused as exc:
        # One line naming --db, as `stoker serve` says it, not a driver traceback.
        print(f"stoker keys: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def cmd_create(args: argparse.Namespace) -> int:
    store = _open(args)
    models = [m for m in args.models.split(",")] if args.models else None
    if (args.budget_period is not None) and args.budget_tokens is None:
        print("error: --budget-period needs --budget-tokens", file=sys.stderr)
        return 2
    try:
        key, secret = store.create(
            args.name,
            rpm=args.rpm,
            tpm=args.tpm,
            max_concurrent=args.max_concurrent,
            budget_tokens=args.budget_tokens,
            budget_period=args.budget_period or "month",
            priority=args.priority,
            models=models,
            expires_at=args.expires,
            admin=args.admin,
            scopes=args.scope,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**key.public(), "secret": secret}, indent=2))
    else:
        print(f"created key {key.id} ({key.name}){' [admin]' if key.is_admin else ''}")
        print(f"  scopes:  {', '.join(key.scopes)}")
        print(f"  limits:  {_limits(key.public())}")
        print(f"  expires: {_when(key.expires_at)}")
        print("\nsecret (shown once; store it now, it cannot be recovered):\n")
        print(f"  {secret}\n")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    keys = [k.public() for k in _open(args).list_keys(include_revoked=args.all)]
    if args.json:
        print(json.dumps(keys, indent=2))
        return 0
    if not keys:
        print("no keys (a server on this database runs open, inference only, until one is created)")
        return 0
    print(f"{'ID':<13} {'NAME':<20} {'STATUS':<8} {'PRIORITY':<11} {'SCOPES':<27} {'EXPIRES':<21} LIMITS")
    for k in keys:
        print(
            f"{k['id']:<13} {k['name'][:20]:<20} {k['status']:<8} {k['priority']:<11} "
            f"{','.join(k['scopes']):<27} {_when(k['expires_at']):<21} {_limits(k)}"
        )
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    store = _open(args)
    if store.get(args.key_id) is None:
        print(f"error: no key with id {args.key_id}", file=sys.stderr)
        return 1
    if store.revoke(args.key_id):
        print(f"revoked {args.key_id}")
    else:
        print(f"{args.key_id} was already revoked")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from stoker.control.ledger import UsageLedger

    store = _open(args)
    key = store.get(args.key_id)
    if key is None:
        print(f"error: no key with id {args.key_id}", file=sys.stderr)
        return 1

    usage = UsageLedger(store.engine).key_report(key.id, key.budget_period, key.budget_tokens)
    info = {**key.public(), "usage": usage}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"key {key.id}: {key.name} [{info['status']}]{' [admin]' if key.is_admin else ''}")
    print(f"  prefix:   {key.prefix}...")
    print(f"  scopes:   {', '.join(key.scopes)}")
    print(f"  priority: {key.priority}")
    print(f"  models:   {', '.join(key.models) if key.models else 'all'}")
    print(f"  limits:   {_limits(info)}")
    print(f"  created:  {_when(key.created_at)}   expires: {_when(key.expires_at)}   revoked: {_when(key.revoked_at)}")
    for label, u in (
        ("this " + key.budget_period, info["usage"]["this_period"]),
        ("all time", info["usage"]["all_time"]),
    ):
        print(
            f"  usage {label}: {u['requests']} requests, {u['prompt_tokens']} prompt "
            f"({u['cached_tokens']} cached) + {u['completion_tokens']} completion = {u['total_tokens']} tokens"
        )
    if "budget_remaining" in info["usage"]:
        print(f"  budget remaining: {info['usage']['budget_remaining']} tokens")
    return 0


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = subparsers.add_parser(
        "keys", help="manage API keys", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )

    def print_keys_help(_args: argparse.Namespace) -> int:
        keys.print_help()
        return 2

    keys.set_defaults(func=print_keys_help)
    sub = keys.add_subparsers(dest="keys_command", metavar="ACTION")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--db", default=None, help=f"SQLite path or database URL (default {default_db_url()})")
        p.add_argument("--json", action="store_true", help="machine-readable output")

    create = sub.add_parser("create", help="create a key and print its secret once")
    common(create)
    create.add_argument("--name", required=True)
    create.add_argument("--rpm", type=int, help="requests per minute")
    create.add_argument("--tpm", type=int, help="tokens (prompt + max_tokens, reconciled) per minute")
    create.add_argument("--max-concurrent", type=int, help="requests in flight at once")
    create.add_argument("--budget-tokens", type=int, help="tokens per budget period (429 insufficient_quota beyond)")
    create.add_argument("--budget-period", choices=["day", "month"], help="budget period, UTC (default month)")
    create.add_argument("--priority", choices=["interactive", "batch"], default="interactive")
    create.add_argument("--models", help="comma-separated models this key may use (default all)")
    create.add_argument(
        "--expires", type=parse_expiry, help="YYYY-MM-DD (valid through that day, UTC), ISO datetime, or 30d/12h"
    )
    create.add_argument(
        "--admin",
        action="store_true",
        help="may use the /admin API, load models, and everything the other scopes allow",
    )
    create.add_argument(
        "--scope",
        action="append",
        choices=SCOPES,
        help="what the key may call (repeat for several; default inference): inference (/v1, tokenizer routes), "
        "router (/get_load, /server_info, /model_info, /flush_cache: for sglang-router/vllm-router), "
        "metrics (/metrics: for Prometheus), admin (everything)",
    )
    create.set_defaults(func=cmd_create)

    lst = sub.add_parser("list", help="list keys")
    common(lst)
    lst.add_argument("--all", action=argparse.BooleanOptionalAction, default=True, help="include revoked keys")
    lst.set_defaults(func=cmd_list)

    revoke = sub.add_parser("revoke", help="revoke a key (running servers notice within seconds)")
    common(revoke)
    revoke.add_argument("key_id")
    revoke.set_defaults(func=cmd_revoke)

    show = sub.add_parser("show", help="a key's settings and usage so far")
    common(show)
    show.add_argument("key_id")
    show.set_defaults(func=cmd_show)

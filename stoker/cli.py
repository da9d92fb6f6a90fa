"""`stoker` command line: each area registers its own subcommands."""

from __future__ import annotations

import argparse
import importlib
import sys

# (module, description): each module defines add_parser(subparsers) and sets
# args.func; imports are deferred so `stoker --help` stays fast.
SUBCOMMAND_MODULES = [
    "stoker.engine.cli",  # generate / chat (offline)
    "stoker.server.cli",  # serve
    "stoker.bench.cli",  # bench offline | serve
    "stoker.control.cli",  # keys
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stoker", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue  # that area is not built yet
            raise
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

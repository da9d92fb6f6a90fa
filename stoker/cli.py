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
    "stoker.server.models_cli",  # models (admin API client)
    "stoker.server.prefixes_cli",  # prefixes (admin API client)
]


COMMAND_MODULES = {
    "generate": "stoker.engine.cli",
    "chat": "stoker.engine.cli",
    "serve": "stoker.server.cli",
    "bench": "stoker.bench.cli",
    "keys": "stoker.control.cli",
    "models": "stoker.server.models_cli",
    "prefixes": "stoker.server.prefixes_cli",
}
"""Which module registers a command, so running one imports only its module: `stoker
serve` must not pay for `stoker bench kernels`' torch import before it spawns its engine."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand, or only `command`'s module's when it is a known command."""
    parser = argparse.ArgumentParser(prog="stoker", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = [COMMAND_MODULES[command]] if command in COMMAND_MODULES else SUBCOMMAND_MODULES
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue  # that area is not built yet
            raise
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""How command-line tools (`stoker models`, `stoker bench`) take an API key: from
the environment or a file, never from argv, where `ps`, shell history and
/proc/PID/cmdline show it to every user of the machine.

    --api-key-file PATH    the key, alone in the file (surrounding whitespace ignored)
    $STOKER_API_KEY        otherwise (bench also reads $OPENAI_API_KEY)
    --api-key KEY          refused, with a message saying the two ways above
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


class _RefuseKeyOnCommandLine(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, *_: object, **__: object) -> None:
        parser.error(
            "--api-key would show the key to every user of this machine (ps, /proc, shell history); "
            "set STOKER_API_KEY or pass --api-key-file PATH instead"
        )


def add_key_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup, env: tuple[str, ...]) -> None:
    names = " or ".join(f"${name}" for name in env)
    parser.add_argument("--api-key-file", metavar="PATH", help=f"file holding the API key (default: {names})")
    parser.add_argument("--api-key", nargs="?", action=_RefuseKeyOnCommandLine, help=argparse.SUPPRESS)
    parser.set_defaults(key_env=env)


def api_key_of(args: argparse.Namespace) -> str | None:
    """The key from --api-key-file, else the first of the environment variables set; None: none given.
    ValueError naming the file when it cannot be read or is empty."""
    path = getattr(args, "api_key_file", None)
    if path:
        try:
            key = Path(path).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--api-key-file {path}: cannot read it ({exc})") from None
        if not key:
            raise ValueError(f"--api-key-file {path}: the file is empty")
        return key
    for name in getattr(args, "key_env", ()):
        if os.environ.get(name):
            return os.environ[name]
    return None

"""The content digest that pins a model version (`--model NAME=PATH@sha256:HEX`).

A file (a GGUF) is pinned by the SHA-256 of its bytes, the same as
`sha256sum FILE`. A folder (Hugging Face layout) is pinned by the SHA-256 of
a manifest: one `sha256sum`-style line per weight, config and tokenizer file
("<hex>  <path relative to the folder>\\n"), sorted by path. The same digest
comes from

    cd FOLDER && find . -type f \\( -name '*.safetensors' -o -name '*.bin' -o -name '*.gguf' \\
        -o -name '*.json' -o -name '*.model' -o -name '*.txt' -o -name '*.jinja' \\) \\
        -not -path '*/.*' | sed 's|^\\./||' | LC_ALL=C sort | xargs sha256sum | sha256sum

README files, images and hidden folders (.git, .cache) do not count, so
editing a model card does not change which version a pin accepts.

Only regular files are read (a symlink counts as what it points to): a
device (/dev/zero) or a FIFO never ends or never answers, so it is refused
before a byte is read. A caller that bounds the time it waits passes a
threading.Event: once set, hashing stops at its next chunk (DigestCancelled).
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import threading
from pathlib import Path

DIGEST_PATTERN = re.compile(r"^sha256:[0-9a-f]{64}$")
PINNED_SUFFIXES = (".safetensors", ".bin", ".gguf", ".json", ".model", ".txt", ".jinja")
_CHUNK = 8 << 20


class DigestCancelled(OSError):
    """The caller stopped waiting (its timeout, an unload, a shutdown)."""


def open_regular(path: str | Path) -> int:
    """A read-only descriptor of a regular file; OSError for anything else.
    O_NONBLOCK: opening a FIFO would otherwise wait for a writer forever (it
    changes nothing for a regular file), and the type is checked on what was
    opened, so a path swapped after a check cannot slip a device in."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    return fd


def file_sha256(path: str | Path, cancel: threading.Event | None = None) -> str:
    digest = hashlib.sha256()
    with os.fdopen(open_regular(path), "rb") as f:
        while chunk := f.read(_CHUNK):
            if cancel is not None and cancel.is_set():
                raise DigestCancelled(f"{path}: hashing stopped")
            digest.update(chunk)
    return digest.hexdigest()


def pinned_files(folder: str | Path, cancel: threading.Event | None = None) -> list[str]:
    """The folder's files a digest covers, as sorted relative POSIX paths."""
    root = Path(folder)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        if cancel is not None and cancel.is_set():
            raise DigestCancelled(f"{folder}: listing stopped")
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.endswith(PINNED_SUFFIXES) and not name.startswith("."):
                found.append((Path(dirpath) / name).relative_to(root).as_posix())
    # sort's C locale orders by bytes, as Python orders encoded strings.
    return sorted(found, key=lambda p: p.encode())


def model_digest(path: str | Path, cancel: threading.Event | None = None) -> str:
    """ "sha256:<hex>" of a model file or folder (see the module docstring).
    OSError when it cannot be read, is no regular file or folder, or cancel
    was set (DigestCancelled); ValueError for a folder with no pinned file."""
    if os.path.isdir(path):
        files = pinned_files(path, cancel)
        if not files:
            raise ValueError(f"{path}: no weight, config or tokenizer file to digest")
        manifest = "".join(f"{file_sha256(Path(path) / rel, cancel)}  {rel}\n" for rel in files)
        return "sha256:" + hashlib.sha256(manifest.encode()).hexdigest()
    return "sha256:" + file_sha256(path, cancel)


def check_digest_syntax(digest: str) -> str:
    """The digest in canonical (lower case) form; ValueError naming the expected form."""
    canonical = digest.strip().lower()
    if not DIGEST_PATTERN.match(canonical):
        raise ValueError(f"digest {digest!r} is not of the form sha256:<64 hex digits>")
    return canonical

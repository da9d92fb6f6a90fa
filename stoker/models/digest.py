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

Hashing an 8B GGUF takes a core 3-5 s, on every start. Where nothing is
pinned (the digest names the version; the disk tier keys its blocks by it),
model_digest(reuse=True) takes a file's hash from the last time it was read
if the file is still the same inode with the same size, modification and
change times: a write changes the change time, which no user can set back.
A pin is always checked against the bytes themselves.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import threading
from pathlib import Path

from stoker.models.identity import cache_root

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


def model_digest(path: str | Path, cancel: threading.Event | None = None, reuse: bool = False) -> str:
    """ "sha256:<hex>" of a model file or folder (see the module docstring);
    reuse: a file's hash from an earlier read of the very same file. OSError
    when it cannot be read, is no regular file or folder, or cancel was set
    (DigestCancelled); ValueError for a folder with no pinned file."""
    hash_file = reused_file_sha256 if reuse else file_sha256
    if os.path.isdir(path):
        files = pinned_files(path, cancel)
        if not files:
            raise ValueError(f"{path}: no weight, config or tokenizer file to digest")
        manifest = "".join(f"{hash_file(Path(path) / rel, cancel)}  {rel}\n" for rel in files)
        return "sha256:" + hashlib.sha256(manifest.encode()).hexdigest()
    return "sha256:" + hash_file(path, cancel)


def reused_file_sha256(path: str | Path, cancel: threading.Event | None = None) -> str:
    """file_sha256, taken from the digest cache while the file's identity
    (inode, size, modification and change times) is what it was when hashed."""
    entry = cache_root() / "digests" / (hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:32] + ".json")
    before = _identity(path)
    try:
        saved = json.loads(entry.read_text())
        if saved["identity"] == before and DIGEST_PATTERN.match("sha256:" + saved["sha256"]):
            return str(saved["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or unreadable: hashed below and written again
    hexdigest = file_sha256(path, cancel)
    if _identity(path) == before:  # not written to while it was read
        with contextlib.suppress(OSError):
            entry.parent.mkdir(parents=True, exist_ok=True)
            partial = entry.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps({"identity": before, "sha256": hexdigest}))
            os.replace(partial, entry)
    return hexdigest


def _identity(path: str | Path) -> list[int]:
    st = os.stat(path)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def check_digest_syntax(digest: str) -> str:
    """The digest in canonical (lower case) form; ValueError naming the expected form."""
    canonical = digest.strip().lower()
    if not DIGEST_PATTERN.match(canonical):
        raise ValueError(f"digest {digest!r} is not of the form sha256:<64 hex digits>")
    return canonical

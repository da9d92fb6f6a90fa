"""What a model path is and is called, and where its GGUF caches live, known
without loading it.

Nothing here imports torch, transformers or gguf: the HTTP front end names its
models and answers /model_info from these before (and while) the engine
process loads, and an `import torch` on that path would delay the engine's
start by a second or more.
"""

from __future__ import annotations

import hashlib
import os
import re
from importlib.metadata import version
from pathlib import Path

# Bump when the cached layout or its derivation changes, so stale entries are ignored.
CACHE_VERSION = "2"  # 2: converted tokenizers saved under the generic class where equivalent

_QUANT_SUFFIX = re.compile(r"[._-](i?q\d\w*|f16|f32|bf16|fp16|fp32)$")


def cache_root() -> Path:
    return Path(os.environ.get("STOKER_CACHE_DIR") or Path.home() / ".cache" / "stoker")


def is_gguf(path: str) -> bool:
    """A GGUF file (by its magic), not a Hugging Face folder; FileNotFoundError when neither."""
    if os.path.isdir(path):
        return False
    if not os.path.isfile(path):  # a device or a FIFO is no model either (and opening a FIFO would wait)
        raise FileNotFoundError(f"no model at {path!r}: expected a .gguf file or a Hugging Face folder")
    # O_NONBLOCK: a path swapped for a FIFO after the check above is not waited on.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read(4) == b"GGUF"
        except BlockingIOError:
            return False


def model_name(path: str) -> str:
    """The name a model is served under unless --served-model-name says otherwise
    (ModelConfig.name): a GGUF's file name without its quantization suffix, a
    folder's name; lower case."""
    if is_gguf(path):
        return gguf_model_name(path)
    return Path(path).resolve().name.lower()


def tokenizer_folder(path: str) -> str:
    """A folder holding the model's tokenizer in Hugging Face's layout
    (tokenizer.json, tokenizer_config.json), which other tools (a router) can
    load: the model's own folder, or for a GGUF the one converted from its
    header into the cache (present once the model has been loaded)."""
    if is_gguf(path):
        return str(gguf_tokenizer_folder(path))
    return os.path.abspath(path)


def gguf_model_name(path: str) -> str:
    """A GGUF's model name: its file name in lower case, without the quantization suffix."""
    stem = os.path.basename(path).lower().removesuffix(".gguf")
    return _QUANT_SUFFIX.sub("", stem) or stem


def gguf_cache_dir(path: str) -> Path:
    """Identity of a GGUF: path, size, mtime and its first MiB (header + vocabulary).

    Hashing whole multi-GB files would cost more than the cache saves; the
    conversion code's versions are part of the key because they shape the output.
    """
    st = os.stat(path)
    h = hashlib.sha256()
    ident = [
        CACHE_VERSION,
        os.path.abspath(path),
        st.st_size,
        st.st_mtime_ns,
        version("gguf"),
        version("transformers"),
    ]
    h.update(repr(ident).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
    return cache_root() / "gguf" / h.hexdigest()[:32]


def gguf_tokenizer_folder(path: str) -> Path:
    """Where the GGUF loader keeps the tokenizer it converted from this GGUF."""
    return gguf_cache_dir(path) / "tokenizer"

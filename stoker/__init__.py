"""stoker: a production LLM inference server."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from stoker.engine.params import RequestOutput, SamplingParams

if TYPE_CHECKING:
    from stoker.engine.llm import LLM

try:  # pyproject.toml's version is the one place it is written
    __version__ = version("stoker")
except PackageNotFoundError:  # a source tree on PYTHONPATH that was never installed
    __version__ = "0+unknown"
__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str) -> type[LLM]:
    # LLM pulls in torch; keep `import stoker` light for the CLI and server front end.
    if name == "LLM":
        from stoker.engine.llm import LLM

        return LLM
    raise AttributeError(name)

"""stoker: a production LLM inference server."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stoker.engine.params import RequestOutput, SamplingParams

if TYPE_CHECKING:
    from stoker.engine.llm import LLM

__version__ = "0.1.0"
__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str) -> type[LLM]:
    # LLM pulls in torch; keep `import stoker` light for the CLI and server front end.
    if name == "LLM":
        from stoker.engine.llm import LLM

        return LLM
    raise AttributeError(name)

"""The server's shared state, reachable from every route as request.app.state.stoker."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from stoker.engine.client import AsyncEngineClient
from stoker.errors import APIError
from stoker.server.config import ServerConfig
from stoker.server.hooks import ServerHooks
from stoker.server.protocol import unavailable
from stoker.server.structured import GrammarChecker

if TYPE_CHECKING:
    from stoker.models.embedding import EmbeddingBatcher


@dataclass
class ServerState:
    config: ServerConfig
    engine: AsyncEngineClient
    served_model_name: str | None = None
    """Set once the engine is loaded (the default comes from the model's file name)."""
    embedder: EmbeddingBatcher | None = None
    embeddings_disabled: str | None = None
    """Why no embedding model is served although one was configured (its package is missing)."""
    hooks: ServerHooks = field(default_factory=ServerHooks)
    loaded: bool = False
    """Engine loaded and warmed up once, embedding model loaded."""
    draining: bool = False
    startup_error: str | None = None
    started: float = field(default_factory=time.time)
    extras: dict[str, Any] = field(default_factory=dict)
    """Room for control/observe objects (metrics registry, admission controller, ...)."""
    engine_ids_in_use: set[str] = field(default_factory=set)
    """Engine request ids (bases) of jobs in flight; see serving.run_job."""
    _token_text: dict[int, str] = field(default_factory=dict)
    _grammars: GrammarChecker | None = None

    @property
    def grammars(self) -> GrammarChecker:
        """Checks output constraints compile (built on the first constrained request)."""
        if self._grammars is None:
            self._grammars = GrammarChecker(
                self.engine.tokenizer, self.config.max_grammar_bytes, self.config.grammar_compile_timeout
            )
        return self._grammars

    @property
    def ready(self) -> bool:
        return self.loaded and self.engine.ready and not self.draining

    def check_accepting(self) -> None:
        """503 unless new generation work can be taken right now."""
        if self.draining:
            raise unavailable("the server is shutting down")
        if not self.loaded:
            raise unavailable("the model is still loading")
        if not self.engine.ready:
            raise unavailable("the engine is restarting; please retry")

    def check_model(self, name: str | None) -> str:
        """The chat model's served name, or 404 for any other name."""
        self.check_accepting()
        assert self.served_model_name is not None
        if name is not None and name != self.served_model_name:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
        return self.served_model_name

    def token_text(self, token_id: int) -> str:
        """A token's text for logprobs, cached: it never changes for a model."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.engine.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text


def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.stoker
    return state


async def run_before_hooks(request: Request) -> None:
    """FastAPI dependency on every API route: authentication and limits plug in here."""
    await get_state(request).hooks.run_before(request)

"""The server's shared state, reachable from every route as request.app.state.stoker."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from stoker.engine.client import AsyncEngineClient
from stoker.errors import APIError
from stoker.server.config import ServerConfig
from stoker.server.fleet import Fleet, ModelVersion, ServedModel
from stoker.server.hooks import AdmissionInfo, FinishedRecord, ServerHooks
from stoker.server.protocol import unavailable
from stoker.server.responses_store import ResponseStore

if TYPE_CHECKING:
    from stoker.models.embedding import EmbeddingBatcher


@dataclass
class ServerState:
    config: ServerConfig
    fleet: Fleet
    embedder: EmbeddingBatcher | None = None
    embeddings_disabled: str | None = None
    """Why no embedding model is served although one was configured (its package is missing)."""
    hooks: ServerHooks = field(default_factory=ServerHooks)
    loaded: bool = False
    """Every model loaded and warmed up once, embedding model loaded."""
    draining: bool = False
    startup_error: str | None = None
    started: float = field(default_factory=time.time)
    extras: dict[str, Any] = field(default_factory=dict)
    """Room for control/observe objects (metrics registry, admission controller, ...)."""
    engine_ids_in_use: set[str] = field(default_factory=set)
    """Engine request ids (bases) of jobs in flight; see serving.run_job."""
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(0))
    """Stored /v1/responses answers (sized by config.responses_store_size)."""

    @property
    def default_version(self) -> ModelVersion:
        """The first model's serving version: what single-model routes
        (/get_load's identity, /server_info, /flush_cache) describe."""
        if self.fleet.models:
            return self.fleet.default.stable
        return self.fleet.initial[0]

    @property
    def engine(self) -> AsyncEngineClient:
        return self.default_version.engine

    @property
    def served_model_name(self) -> str | None:
        return self.fleet.default.name if self.loaded and self.fleet.models else None

    def engines(self) -> list[AsyncEngineClient]:
        """Every engine with requests to account for, retiring ones included."""
        return [v.engine for v in self.fleet.versions()] or [v.engine for v in self.fleet.initial]

    @property
    def num_in_flight(self) -> int:
        return sum(e.num_in_flight for e in self.engines())

    @property
    def ready(self) -> bool:
        return self.loaded and not self.draining and all(m.available for m in self.fleet.models.values())

    def check_accepting(self) -> None:
        """503 unless the server takes new generation work at all (drain, start-up)."""
        if self.draining:
            raise unavailable("the server is shutting down")
        if not self.loaded:
            raise unavailable("the model is still loading")

    def resolve(self, name: str | None) -> ServedModel:
        """The model a request names (404 listing the models for any other name)."""
        self.check_accepting()
        return self.fleet.resolve(name)

    def version_for(self, name: str | None) -> ModelVersion:
        """A ready version of the named model for a request without fallback (tokenize, ...)."""
        model = self.resolve(name)
        self.fleet.check_kind(model, "generate", "generation or tokenization")
        self.fleet.check_available(model)
        return self.fleet.pick(model)


def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.stoker
    return state


async def operator_state(request: Request) -> ServerState:
    """The state for an operator's change to the fleet (models, sleep): the key may operate
    (hooks.run_operator), and the server is loaded and not shutting down."""
    state = get_state(request)
    await state.hooks.run_operator(request)
    if state.draining:
        raise APIError(503, "the server is shutting down", type="service_unavailable", code="draining")
    if not state.loaded:
        raise APIError(503, "the server is still loading its models", type="service_unavailable", retry_after=1)
    return state


async def run_before_hooks(request: Request) -> None:
    """FastAPI dependency on every API route: authentication and limits plug in here."""
    await get_state(request).hooks.run_before(request)


# Endpoints whose work never enters an engine's queue: admitted against the
# key's quotas (model allow-list, budget, rate) but not against engine capacity.
OUTSIDE_ENGINE = frozenset({"embedding", "tokenize", "detokenize", "render", "count_tokens", "rerank", "score"})
POOLING_ENDPOINTS = frozenset({"rerank", "score"})
"""Outside the engine, yet served by a fleet model's version (a reranker): metered per version as generation is."""


@contextlib.asynccontextmanager
async def admitted(request: Request, endpoint: str, model: str) -> AsyncIterator[None]:
    """Tokenizer work (/tokenize, /detokenize, render, count_tokens) admitted as
    generation is, before any of it runs: the key's model allow-list (403), its
    budget and its request rate (429). Its tokens never reach an engine, so they
    are not metered (tpm, budget); the finished hook runs however it ends."""
    state = get_state(request)
    info = AdmissionInfo(endpoint=endpoint, model=model, prompt_tokens=0, max_tokens=0, n=1, stream=False)
    await state.hooks.run_admit(request, info)
    status = 500
    try:
        yield
        status = 200
    except APIError as exc:
        status = exc.status
        raise
    except UnicodeEncodeError:  # lone surrogates in the client's text: the app answers 400
        status = 400
        raise
    finally:
        state.hooks.run_finished(
            FinishedRecord(request_id="", endpoint=endpoint, model=model, status=status, http_request=request)
        )

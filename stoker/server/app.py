"""The FastAPI app: lifespan (start the engine in the background, so /health
answers while the model loads), error shapes, body limit, drain."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import importlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import stoker
from stoker.config import EngineConfig
from stoker.engine.client import AsyncEngineClient
from stoker.engine.pooling import PoolingEngine
from stoker.engine.prestart import discard as discard_prestarted
from stoker.errors import APIError
from stoker.models.identity import tokenizer_folder
from stoker.models.tokenizer import preload_backend, preload_hf_tokenizer
from stoker.server import console_data, openapi
from stoker.server.bounds import MAX_JSON_DEPTH, offload
from stoker.server.config import ServerConfig, parse_peers
from stoker.server.fleet import Fleet, FleetError, ModelVersion, plan_fleet
from stoker.server.host_guard import HostGuardMiddleware
from stoker.server.kv_roles import check_peers
from stoker.server.lora import plan_adapters
from stoker.server.reasoning import parse_parser_choices
from stoker.server.responses_store import ResponseStore
from stoker.server.routes import (
    anthropic,
    console,
    embeddings,
    health,
    lora,
    models,
    openai,
    prefixes,
    rerank,
    responses,
    sleep,
    tokens,
    workers,
)
from stoker.server.sleep import parse_sleep_choices
from stoker.server.state import ServerState
from stoker.server.strict_json import StrictJSONResponse
from stoker.server.structured import GrammarChecker

logger = logging.getLogger("stoker.server")

# Optional modules that plug other areas in; each defines install(app, state) to add
# hooks, routes (/admin, /metrics), middleware and exception handlers. One
# that is not installed is skipped. (observe has no extension of its own:
# control's wires metrics, logs and traces into the request path.) They live in
# the server layer: they import control, control never imports the server.
EXTENSIONS = ["stoker.server.control"]


class BodyLimitMiddleware:
    """413 for bodies over the limit, by Content-Length or by counting a chunked body,
    before any of it is parsed; 408 for a body not all sent within timeout seconds."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float = 60.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                return await _too_large(self.max_bytes)(scope, receive, send)
        seen = 0
        complete = False
        deadline = asyncio.get_running_loop().time() + self.timeout

        async def limited() -> Message:
            nonlocal seen, complete
            if complete:  # later calls wait for the client's disconnect: no deadline on those
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise HTTPException(
                    408, f"request body not received within {self.timeout:g} s (--body-read-timeout)"
                ) from None
            complete = message["type"] != "http.request" or not message.get("more_body", False)
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:  # FastAPI passes HTTPException through as is
                raise HTTPException(413, f"request body exceeds {self.max_bytes} bytes")
            return message

        await self.app(scope, limited, send)


def _too_large(limit: int) -> StrictJSONResponse:
    return StrictJSONResponse(APIError(413, f"request body exceeds {limit} bytes").body(), status_code=413)


def _is_type_tag(part: str) -> bool:
    return (
        "[" in part
        or part in ("str", "int", "float", "bool", "list", "dict")
        or part.startswith(("function-", "constrained-"))
        or part in _model_names()
    )


@functools.cache
def _model_names() -> frozenset[str]:
    """Class names of the request models: pydantic tags a union's model branches with them."""
    seen: set[type[BaseModel]] = set()
    pending = list(BaseModel.__subclasses__())
    while pending:
        model = pending.pop()
        if model not in seen:
            seen.add(model)
            pending.extend(model.__subclasses__())
    return frozenset(model.__name__ for model in seen if model.__module__.startswith("stoker."))


# Errors that say a union's branch did not fit the input's shape at all; one
# that did fit (a list that is empty, a number out of range) says more.
_SHAPE_MISMATCH = frozenset(
    {
        "missing",
        "literal_error",
        "string_type",
        "int_type",
        "float_type",
        "bool_type",
        "list_type",
        "dict_type",
        "model_type",
        "model_attributes_type",
        "union_tag_invalid",
        "is_instance_of",
    }
)


def _error_path(error: Any) -> list[str]:
    """An error's place in the body: without "body" and pydantic's union-member tags (str, list[int], ...)."""
    return [str(p) for p in error.get("loc", ()) if p != "body" and not (isinstance(p, str) and _is_type_tag(p))]


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    # The branch that fit the input best: not a shape mismatch, then the deepest;
    # a wrong value names the problem better than a field missing beside it.
    first = min(
        errors, key=lambda e: (e.get("type") in _SHAPE_MISMATCH, e.get("type") == "missing", -len(_error_path(e)))
    )
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    where = ".".join(_error_path(first))
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return (f"{where}: {message}" if where else message), (where or None)


def _allowed_methods(request: Request) -> str:
    """Every method some route serves at this path: Starlette's 405 names only
    the first route that matched the path (GET /admin/keys/{id} hid DELETE).
    Asked of the routes by method, as routing would, since FastAPI keeps an
    included router's routes behind one entry."""
    routes = request.app.router.routes
    allowed = [
        method
        for method in ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
        if any(route.matches({**request.scope, "method": method})[0] == Match.FULL for route in routes)
    ]
    return ", ".join(allowed)


def install_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, exc: Exception) -> StrictJSONResponse:
        assert isinstance(exc, APIError)
        return StrictJSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def validation(_: Request, exc: Exception) -> StrictJSONResponse:
        assert isinstance(exc, RequestValidationError)
        message, param = _validation_message(exc)
        return StrictJSONResponse(APIError(400, message, param=param).body(), status_code=400)

    async def http_error(request: Request, exc: Exception) -> StrictJSONResponse:
        assert isinstance(exc, HTTPException)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        detail = str(exc.detail)
        if isinstance(exc.__cause__, RecursionError):  # FastAPI's "error parsing the body" says no more
            detail = f"the JSON body is nested too deeply (up to {MAX_JSON_DEPTH} levels are always accepted)"
        body = APIError(exc.status_code, detail, type=kind).body()
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:
            headers = {**(headers or {}), "Allow": _allowed_methods(request)}
        return StrictJSONResponse(body, status_code=exc.status_code, headers=headers)

    async def unexpected(_: Request, exc: Exception) -> StrictJSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        body = APIError(500, "internal server error", type="server_error").body()
        return StrictJSONResponse(body, status_code=500)

    async def bad_text(_: Request, exc: Exception) -> StrictJSONResponse:
        # JSON escapes can carry lone surrogates ("\ud800"), which no encoder
        # (tokenizer, database) accepts: the client's text, so a 400.
        body = APIError(400, "strings must be valid Unicode text (no lone surrogates)", code="invalid_text").body()
        return StrictJSONResponse(body, status_code=400)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(UnicodeEncodeError, bad_text)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


async def load(state: ServerState, on_fatal: Callable[[str], None]) -> None:
    """Start every model's engine and the embedding model; announce where we serve."""
    start = time.monotonic()
    try:
        # The front end's own loading (torch and transformers imports, the embedding
        # model) runs while the engine processes load, not after them.
        front_end = asyncio.to_thread(_prepare_front_end, state)
        versions: list[ModelVersion]
        try:
            versions, state.embedder = await asyncio.gather(state.fleet.start(), front_end)
        finally:
            discard_prestarted()  # a model that failed to load, or a rerank model, left its engine unused
        # Each version's chat tokenizer (ModelVersion.load_chat_tokenizer), once the thread
        # above has imported transformers: two threads importing it at once can see it
        # half-initialised.
        for version in versions:
            await asyncio.to_thread(version.load_chat_tokenizer)
            # The input pool's first call starts its thread and the tokenizer's own pool:
            # done here, not inside the first client's request.
            await offload(version.tokenizer.encode, "warm up")
        if state.config.kv_peers:  # a decode worker's prefill workers must compute the same bytes (kv_roles.py)
            layouts = [v.engine.info.kv_layout for v in versions if v.engine.info and v.engine.info.kv_layout]
            await check_peers(parse_peers(state.config.kv_peers), layouts)
    except (FleetError, OSError, ValueError) as exc:
        state.startup_error = str(exc)
        on_fatal(str(exc))
        return
    state.loaded = True
    # What start-up loaded (FastAPI's routes, pydantic's schemas, transformers, the
    # tokenizers) lives as long as the process: out of the collector's generations,
    # full collections while serving no longer walk it, and the one at exit is short
    # (it was most of a test server's 1 s stop). The engine process does the same.
    gc.freeze()
    embedding = f", embeddings: {state.embedder.name}" if state.embedder else ""
    scheme = "https" if state.config.ssl_certfile else "http"
    for version in versions:
        info = version.engine.info
        assert info is not None
        print(
            f"stoker: serving {version.name} ({version.spec.path}, {version.digest}) on "
            f"{scheme}://{state.config.host}:{state.config.port}{embedding}; KV cache {info.kv_capacity_tokens} tokens, "
            f"context {info.max_model_len}"
            f"{f'; thinks ({version.reasoning.parser} parser)' if version.reasoning else ''}; "
            f"engine loaded in {info.load_seconds:.1f} s, "
            f"ready in {time.monotonic() - start:.1f} s",
            flush=True,
        )
        embedding = ""


def _prepare_front_end(state: ServerState) -> Any:
    """What the front end needs besides the engine: the tokenizers of the models
    the engines will send theirs without (stoker.models.tokenizer), transformers
    for their chat templates (its import takes 0.6-2 s), and the embedding
    model, if any (returned)."""
    # A missing or bad file is passed over here: its engine's start says why.
    folders: list[Path] = []
    for version in (v for v in state.fleet.initial if v.spec.kind == "generate"):
        with contextlib.suppress(OSError, ValueError):  # a GGUF's folder is named by hashing its header
            folders.append(Path(tokenizer_folder(version.spec.path)))
    # The backends first: each engine's tokenizer is unpickled with its own the moment that engine is ready.
    for folder in folders:
        with contextlib.suppress(OSError, ValueError):
            preload_backend(folder)
    import transformers

    _ = transformers.PreTrainedTokenizerFast  # transformers imports its submodules on first use
    for folder in folders:
        with contextlib.suppress(OSError, ValueError):
            preload_hf_tokenizer(folder)
    if not state.config.embedding_model:
        return None
    return _load_embedder(state)


def _load_embedder(state: ServerState) -> Any:
    """The embedding model, or None when the bundled one's package is not
    installed: embeddings are an optional part, so the server starts without
    them (one log line; /v1/embeddings answers 404 saying why). A model the
    user named by path must load, or startup fails."""
    from stoker.models.embedding import (
        BUNDLED_NAME,
        EmbeddingBatcher,
        EmbeddingModel,
        bundled_model_path,
    )

    config = state.config
    name = config.embedding_model
    if name == BUNDLED_NAME:
        try:
            path = bundled_model_path()
        except FileNotFoundError as exc:
            state.embeddings_disabled = f"embeddings are disabled: {exc}"
            logger.warning("%s", state.embeddings_disabled)
            return None
    else:
        path = str(name)
    return EmbeddingBatcher(EmbeddingModel(path), max_batch=config.embedding_batch_size)


async def drain(state: ServerState, timeout: float) -> None:
    """Refuse new work at once; let in-flight requests finish for up to
    timeout seconds; then abort the rest (they end with finish_reason "abort")."""
    state.draining = True
    state.fleet.abort_loads("the server is shutting down")  # a model load would hold the shutdown up
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while state.num_in_flight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if state.num_in_flight:
        logger.warning("drain timeout: aborting %d requests", state.num_in_flight)
        for engine in state.engines():
            engine.abort_all_soft()
        grace = loop.time() + 5.0
        while state.num_in_flight and loop.time() < grace:
            await asyncio.sleep(0.02)


def create_app(
    config: ServerConfig,
    engine_config: EngineConfig,
    on_fatal: Callable[[str], None] | None = None,
    extras: dict[str, Any] | None = None,
) -> FastAPI:
    """extras: extension settings by key (e.g. "control_config"), read by their install().
    FleetError when the model set cannot be served (bad path, digest syntax, fallback cycle)."""
    specs, chains = plan_fleet(config, engine_config)
    fleet = Fleet(
        specs,
        chains,
        engine_config,
        make_engine=lambda c: AsyncEngineClient(c, config.engine_core, config.engine_startup_timeout),
        make_grammars=lambda tokenizer: GrammarChecker(
            tokenizer, config.max_grammar_bytes, config.grammar_compile_timeout
        ),
        max_memory=config.max_model_memory,
        make_pooling_engine=lambda c: PoolingEngine(c, config.rerank_batch_size),
        drain_timeout=config.shutdown_timeout,
        model_roots=config.model_root,
        max_models=config.max_models,
        check_timeout=config.model_check_timeout,
        reasoning_parsers=parse_parser_choices(config.reasoning_parser),
        sleep_idle=parse_sleep_choices(config.sleep_idle_seconds),
        adapters=plan_adapters(config.lora_modules, specs),
    )
    responses_store = ResponseStore(
        config.responses_store_size, config.responses_store_per_key, config.responses_store_entry_bytes
    )
    state = ServerState(config=config, fleet=fleet, extras=dict(extras or {}), responses=responses_store)

    def fatal(message: str) -> None:
        if on_fatal is None:
            logger.error("startup failed: %s", message)
        else:
            on_fatal(message)  # `stoker serve` prints it: one line, not a log line and a print of the same

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(load(state, fatal))
        yield
        loading.cancel()
        if state.embedder is not None:
            state.embedder.close()
        await fleet.shutdown()

    app = FastAPI(
        title="stoker", version=stoker.__version__, lifespan=lifespan, default_response_class=StrictJSONResponse
    )
    app.state.stoker = state
    install_error_handlers(app)
    for router in (
        health.router,
        openai.router,
        responses.router,
        anthropic.router,
        embeddings.router,
        rerank.router,
        tokens.router,
        workers.router,
        models.router,
        lora.router,
        prefixes.router,
        sleep.router,
    ):
        app.include_router(router)
    if config.ui:
        app.include_router(console.router)
    for name in EXTENSIONS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        module.install(app, state)
    if config.ui and hasattr(app.state, "control"):
        console_data.install(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes, timeout=config.body_read_timeout)
    if config.allowed_hosts:
        app.add_middleware(HostGuardMiddleware, allowed=config.allowed_hosts)  # outermost: before any other work
    openapi.install(app, state)
    return app

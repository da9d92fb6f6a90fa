"""`stoker serve`: the OpenAI-compatible server.

Options come from the command line, STOKER_* environment variables and a YAML
file (--config), in that order of precedence; every EngineConfig,
ServerConfig and ControlSettings (keys, limits, admission, metrics, traces)
field is an option.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys
import typing
from types import FrameType
from typing import Any

from pydantic import BaseModel, ValidationError

from stoker.config import EngineConfig
from stoker.engine import prestart
from stoker.errors import StartupRefused
from stoker.server.config import (
    EXTENSION_SKIP,
    ServerConfig,
    add_model_options,
    build,
    extension_settings,
    field_docs,
    load_yaml,
)

logger = logging.getLogger("stoker.server")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description=__doc__,
    )
    parser.add_argument(
        "model_path",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="GGUF file or Hugging Face folder (same as --model)",
    )
    parser.add_argument(
        "--config",
        metavar="YAML",
        default=None,
        help="YAML file of options (keys as the long option names, _ or -); env STOKER_CONFIG",
    )
    add_model_options(parser, EngineConfig, "engine", skip=("model", "kv_role"))
    parser.add_argument(
        "--role",
        "--kv-role",
        dest="kv_role",
        choices=typing.get_args(EngineConfig.model_fields["kv_role"].annotation),
        default=argparse.SUPPRESS,
        help=f"{field_docs(EngineConfig)['kv_role']} (default: both; YAML kv_role; env STOKER_KV_ROLE)",
    )
    add_model_options(parser, ServerConfig, "server", skip=("embedding_model", "models", "fallback"))
    parser.add_argument(
        "--model",
        "--models",
        dest="models",
        action="append",
        metavar="[NAME=]PATH[@sha256:DIGEST]",
        default=argparse.SUPPRESS,
        help="a model to serve (repeat for several, each in its own engine process): a GGUF file or Hugging Face "
        "folder, named NAME (default: after the file), pinned to a digest if given (see docs/models.md)",
    )
    parser.add_argument(
        "--fallback",
        dest="fallback",
        action="append",
        metavar="MODEL=NEXT[,NEXT...]",
        default=argparse.SUPPRESS,
        help="who answers for MODEL when it is down, restarting or overloaded, in order (repeatable)",
    )
    parser.add_argument(
        "--embedding-model",
        dest="embedding_model",
        metavar="PATH",
        default=argparse.SUPPRESS,
        help="embedding model for /v1/embeddings: all-MiniLM-L6-v2 (bundled, the default), "
        "a sentence-transformers BERT folder, or none; env STOKER_EMBEDDING_MODEL",
    )
    parser.add_argument(
        "--no-embedding-model",
        dest="embedding_model",
        action="store_const",
        const=None,
        default=argparse.SUPPRESS,
        help="serve no embedding model",
    )
    for key, cls in extension_settings().items():
        add_model_options(parser, cls, key.removesuffix("_config"), skip=EXTENSION_SKIP.get(key, ()))
    parser.set_defaults(func=run)
    return parser


def _yaml_values(args: argparse.Namespace) -> dict[str, Any]:
    import os

    values = load_yaml(getattr(args, "config", None) or os.environ.get("STOKER_CONFIG"))
    known = set(EngineConfig.model_fields) | set(ServerConfig.model_fields)
    for key, cls in extension_settings().items():
        known |= set(cls.model_fields) - set(EXTENSION_SKIP.get(key, ()))
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"unknown option(s) in the config file: {', '.join(sorted(unknown))}")
    return values


def resolve_configs(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    values = _yaml_values(args)
    if getattr(args, "model_path", None):
        args.model = args.model_path
    engine = build(EngineConfig, values, args)
    server = build(ServerConfig, values, args)
    assert isinstance(engine, EngineConfig) and isinstance(server, ServerConfig)
    return engine, server


def resolve_extension_settings(args: argparse.Namespace) -> dict[str, BaseModel]:
    """{extras key: settings} for each extension, from the same three sources."""
    values = _yaml_values(args)
    return {
        key: build(cls, values, args, skip=EXTENSION_SKIP.get(key, ())) for key, cls in extension_settings().items()
    }


def describe_validation_error(exc: ValidationError) -> list[str]:
    """One line per bad setting, named as the flag that sets it (--kv-cache-tokens:
    must be >= 1, got 0), instead of pydantic's multi-line report."""
    lines = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"])
        message = str(error["msg"]).removeprefix("Value error, ")
        if not field:  # a check across settings: its message names them
            lines.append(message)
            continue
        given = f", got {error['input']!r}" if "input" in error else ""
        lines.append(f"--{field.replace('_', '-')}: {message}{given}")
    return lines


def run(args: argparse.Namespace) -> int:
    # No garbage collection while the front end imports and builds its app (serve() switches it
    # back on before the server runs): the collector walks the ~200,000 objects those imports
    # make again and again to free nothing, ~0.1 s of a core the engine's start wants.
    gc.disable()
    try:
        return _run(args)
    finally:
        gc.enable()
        prestart.discard()  # a start refused before the fleet loaded


def _run(args: argparse.Namespace) -> int:
    try:
        engine_config, server_config = resolve_configs(args)
        # The engine imports torch while this process checks the rest and imports the front
        # end (stoker.engine.prestart): one now, as most servers run one generating model.
        prestart.prestart(server_config.engine_core, 1)
        extras = resolve_extension_settings(args)
        from stoker.server.fleet import plan_fleet

        specs, _ = plan_fleet(server_config, engine_config)  # a bad model set is refused now, in one line
        if server_config.kv_peers and engine_config.kv_role != "decode":
            raise ValueError("--kv-peers names the prefill workers a decode worker pulls from: it needs --role decode")
        check_tls(server_config)
    except ValidationError as exc:
        for line in describe_validation_error(exc):
            print(f"stoker serve: {line}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:
        print(f"stoker serve: {exc}", file=sys.stderr)
        return 2
    from stoker.models.readahead import start_readahead

    # A fleet with several generating models gets the others' engines prestarted now (one
    # left unused, by a fleet of rerank models alone, ends when the fleet is up), and the
    # kernel reads their weights meanwhile (stoker.models.readahead).
    generating = sum(spec.kind == "generate" for spec in specs)
    prestart.prestart(server_config.engine_core, max(generating - 1, 0))
    start_readahead([spec.path for spec in specs])
    return serve(engine_config, server_config, extras)


def check_tls(config: ServerConfig) -> None:
    """ValueError naming the flag when the TLS settings cannot make a server context."""
    import ssl

    from stoker.server.tls import harden

    if (config.ssl_keyfile is None) != (config.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together (the key and the certificate it signs)")
    if config.ssl_certfile is None:
        if config.ssl_ca_certs or config.ssl_cert_reqs:
            raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile and --ssl-keyfile")
        return
    if config.ssl_cert_reqs == ssl.CERT_REQUIRED and not config.ssl_ca_certs:
        raise ValueError("--ssl-cert-reqs 2 (client certificates required) needs --ssl-ca-certs to check them against")
    context = harden(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))
    try:
        context.load_cert_chain(config.ssl_certfile, config.ssl_keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(
            f"--ssl-certfile/--ssl-keyfile: cannot load {config.ssl_certfile} with its key: {exc}"
        ) from None
    if config.ssl_ca_certs:
        try:
            context.load_verify_locations(config.ssl_ca_certs)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"--ssl-ca-certs: cannot load {config.ssl_ca_certs}: {exc}") from None


def connection_limit(server_config: ServerConfig, engine_config: EngineConfig, app: Any) -> int:
    """uvicorn's limit_concurrency: --max-connections, else what admission can hold
    (its queue bound plus every model's running requests) and room for probes and admin calls."""
    if server_config.max_connections is not None:
        return server_config.max_connections
    control = getattr(app.state, "control", None)
    queued = control.settings.max_queued_requests if control is not None else 256
    models = max(1, len(app.state.stoker.fleet.initial))
    return queued + engine_config.max_num_seqs * models + 64


def serve(engine_config: EngineConfig, server_config: ServerConfig, extras: dict[str, Any] | None = None) -> int:
    import uvicorn

    from stoker.server.app import create_app, drain
    from stoker.server.http_protocol import HTTP1Protocol
    from stoker.server.tls import context_factory as tls_context_factory

    logging.basicConfig(level=server_config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    class Server(uvicorn.Server):
        """uvicorn, with SIGTERM/SIGINT starting a drain instead of an immediate stop."""

        exit_code = 0
        loop: asyncio.AbstractEventLoop | None = None
        draining = False

        async def serve(self, sockets: Any = None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # Not recorded in _captured_signals: uvicorn would re-raise it after
            # the shutdown and the process would not exit 0.
            if self.draining or self.loop is None:
                self.should_exit = True
                self.force_exit = self.draining and sig == signal.SIGINT
                return
            self.draining = True
            logger.info("signal %d: draining (up to %.0f s)", sig, server_config.shutdown_timeout)
            self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

        async def _drain(self) -> None:
            await drain(app.state.stoker, server_config.shutdown_timeout)
            self.should_exit = True

    def on_fatal(message: str) -> None:
        print(f"stoker serve: startup failed: {message}", file=sys.stderr, flush=True)
        server.exit_code = 1
        server.should_exit = True

    try:
        app = create_app(server_config, engine_config, on_fatal=on_fatal, extras=extras)
    except StartupRefused as exc:
        print(f"stoker serve: {exc}", file=sys.stderr, flush=True)
        return 2
    uv_config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        loop="uvloop",
        # httptools, with a quiet refusal of HTTP/2 (routers probe for gRPC) and bounded headers
        http=HTTP1Protocol.configured(server_config.header_read_timeout, server_config.max_header_bytes),
        limit_concurrency=connection_limit(server_config, engine_config, app),
        log_level=server_config.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
        lifespan="on",
        ssl_keyfile=server_config.ssl_keyfile,
        ssl_certfile=server_config.ssl_certfile,
        ssl_ca_certs=server_config.ssl_ca_certs,
        ssl_cert_reqs=server_config.ssl_cert_reqs,
        ssl_context_factory=tls_context_factory if server_config.ssl_certfile else None,
    )
    server = Server(uv_config)
    gc.enable()  # from here it answers requests, whose garbage must not pile up (run() switched it off)
    server.run()
    return server.exit_code

"""ServerConfig, and the one mechanism that turns pydantic config models into
`stoker serve` options, YAML keys and STOKER_* environment variables.

Precedence: command line > environment > YAML file > defaults. Each field's
docstring (in the class body) is its --help text, so it is written once.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import itertools
import os
import textwrap
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, field_validator

from stoker.server.reasoning import parse_parser_choices
from stoker.server.sleep import parse_sleep_choices

DEFAULT_EMBEDDING_MODEL = "all-MiniLM-L6-v2"
MAX_KV_PEERS = 64
"""Most prefill workers one decode worker may name with --kv-peers."""

# Settings models of the server's extensions (stoker.control, ...), by the
# ServerState.extras key their install() reads them from. Each becomes a group
# of `stoker serve` options like EngineConfig and ServerConfig; fields listed in
# EXTENSION_SKIP are set by the server itself. A missing module is skipped.
EXTENSION_SETTINGS = {"control_config": "stoker.control.settings:ControlSettings"}
EXTENSION_SKIP = {"control_config": ("model_name",)}


def extension_settings() -> dict[str, type[BaseModel]]:
    """{extras key: settings model} of the extensions present in this install."""
    import importlib

    found: dict[str, type[BaseModel]] = {}
    for key, spec in EXTENSION_SETTINGS.items():
        module_name, _, attr = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and module_name.startswith(exc.name):
                continue
            raise
        found[key] = getattr(module, attr)
    return found


class ServerConfig(BaseModel):
    """How the HTTP front end listens, limits and shuts down."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    host: str = "127.0.0.1"
    """Address to listen on (0.0.0.0 for every interface)."""
    port: int = Field(8000, ge=0, le=65535)
    """TCP port to listen on (0: pick a free one)."""
    embedding_model: str | None = DEFAULT_EMBEDDING_MODEL
    """Embedding model for /v1/embeddings: the bundled all-MiniLM-L6-v2 or a sentence-transformers folder; none disables."""
    embedding_batch_size: int = Field(32, ge=1, le=1024)
    """Most embedding inputs run in one forward pass."""
    rerank_batch_size: int = Field(32, ge=1, le=1024)
    """Most (query, document) pairs a reranker scores in one forward pass, across concurrent requests."""
    shutdown_timeout: float = Field(30.0, ge=0)
    """Seconds in-flight requests may take to finish after SIGTERM; past it they end with finish_reason "abort"."""
    responses_store_size: int = Field(1000, ge=0)
    """Responses (POST /v1/responses) kept in memory, newest first, for previous_response_id and GET /v1/responses/{id}; per server process; 0 keeps none."""
    responses_store_per_key: int = Field(100, ge=1)
    """Stored responses one API key (or open mode, as one owner) may hold; past it the key's own least recently used one goes, never another key's."""
    responses_store_entry_bytes: int = Field(256 * 1024, ge=1024)
    """Largest stored response (the response and its conversation, as JSON); a bigger one is answered with "store": false and not kept (400 if the request said "store": true and its input alone is over). The store holds at most responses-store-size times this."""
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    """Largest accepted request body (the issue's --max-request-bytes); bigger ones get 413 before they are parsed."""
    body_read_timeout: float = Field(60.0, gt=0)
    """Seconds a client may take to send a request body once its headers are in; past it 408 and the connection closes."""
    header_read_timeout: float = Field(10.0, gt=0)
    """Seconds a client may take to send a request's headers (from its first byte, or from connecting); past it 408 and the connection closes (slow-header clients)."""
    max_header_bytes: int = Field(64 * 1024, ge=1024)
    """Largest request line plus headers; bigger ones get 431 and the connection closes."""
    max_connections: int | None = Field(None, ge=1)
    """Connections and requests the HTTP server holds at once; past it new requests get 503. None: the admission queue bound (max-queued-requests) + max-num-seqs per model + 64 for probes and admin."""
    max_prompts_per_request: int = Field(64, ge=1, le=2048)
    """Prompts one /v1/completions request may carry (OpenAI takes up to 2048); more get 400. Each is an engine request of n samples."""
    max_n: int = Field(64, ge=1, le=64)
    """Samples per prompt (n, best_of) one request may ask for; more get 400."""
    max_request_kv_share: float = Field(1.0, gt=0, le=64)
    """Most of the engine's KV cache one request may need, as a share of its capacity: every sample's prompt plus max_tokens, summed; more gets 400 naming the capacity. Above 1 admits requests whose samples can only run in turns."""
    max_grammar_bytes: int = Field(256 * 1024, ge=1024)
    """Largest output constraint (JSON schema, regex, grammar, tool schemas) as a compiled-grammar string; bigger ones get 400."""
    grammar_compile_timeout: float = Field(10.0, gt=0)
    """Seconds an output constraint may take to compile before the request gets 400."""
    engine_startup_timeout: float = Field(900.0, gt=0)
    """Seconds the engine may take to load and warm up before startup fails."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level of the server."""
    get_load_format: Literal["sglang", "vllm"] = "sglang"
    """Body of GET /get_load for the router in front: sglang-router reads [{"dp_rank": 0, "num_tokens": N}], vllm-router {"load": N}."""
    engine_core: str = "stoker.engine.core:EngineCore"
    """module:callable that builds the engine core from an EngineConfig (tests swap in a fake)."""
    ssl_keyfile: str | None = None
    """TLS private key (PEM); with --ssl-certfile the server speaks HTTPS only."""
    ssl_certfile: str | None = None
    """TLS certificate chain (PEM) the server presents."""
    ssl_ca_certs: str | None = None
    """CA bundle (PEM) that client certificates are checked against (mTLS, e.g. between a router and its replicas)."""
    ssl_cert_reqs: int = Field(0, ge=0, le=2)
    """Client certificates: 0 not asked for, 1 checked if sent, 2 required (mTLS; needs --ssl-ca-certs). Python's ssl.CERT_* values, as uvicorn and vLLM take them."""
    allowed_hosts: list[str] = Field(default_factory=list)
    """Host header values this server answers (names, *.example.com, or *; repeat the flag; a YAML list; env: separated by spaces): others get 400, which closes DNS rebinding of a server on 127.0.0.1. Empty: any Host."""
    models: list[str] = Field(default_factory=list)
    """Models to serve besides MODEL, each NAME=PATH[@sha256:DIGEST], each in its own engine process (repeat --model; a YAML list; env: separated by spaces)."""
    lora_modules: list[str] = Field(default_factory=list)
    """LoRA adapters served as models, each [BASE:]NAME=PATH[@sha256:DIGEST]: a PEFT folder or a GGUF LoRA file, applied by BASE's engine (left out: the only model) to the requests that name NAME (repeat the flag; a YAML list; env: separated by spaces; docs/lora.md)."""
    fallback: list[str] = Field(default_factory=list)
    """Fallback chains MODEL=NEXT[,NEXT...]: who answers when MODEL is down, restarting or overloaded (repeat --fallback; a YAML list; env: separated by spaces)."""
    max_model_memory: ByteSize | None = None
    """Memory all models together may hold (e.g. 8GiB); a model that would not fit is refused before it loads. None: no limit."""
    max_models: int = Field(8, ge=1, le=1024)
    """Models (names) the server may hold at once when --max-model-memory is not set; POST /admin/models of one more is refused (409). Each has its own engine process."""
    model_root: list[str] = Field(default_factory=list)
    """Folders POST /admin/models may load from (repeat --model-root; a YAML list; env: separated by spaces); symlinks are resolved first, and only regular files and folders load. Empty: the folders holding the models given at start."""
    model_check_timeout: float = Field(900.0, gt=0)
    """Seconds reading a model's files before it loads (their size, and the sha256 digest, which reads every byte: ~1 s per 1.5 GB) may take; past it the load is refused."""
    reasoning_parser: list[str] = Field(default_factory=list)
    """How thinking models' thinking is kept apart from their answers (docs/reasoning.md): auto, qwen3, deepseek_r1 or none for every model, or NAME=PARSER for one (repeat the flag; a YAML list; env: separated by spaces). auto: a model whose chat template writes <think>/</think> and whose tokenizer holds them as tokens thinks; others do not. A parser whose markers are not tokens of the model's tokenizer stops the start. Empty: auto."""
    reasoning_budget: int | None = Field(None, ge=0, le=2**31 - 1)
    """Thinking tokens a request may spend when it names no budget (reasoning_effort, reasoning_budget, thinking.budget_tokens); then the engine ends the thinking and the answer follows. 0: no thinking. None: only max_tokens bounds it."""
    reasoning_field: Literal["both", "reasoning_content", "reasoning"] = "both"
    """The chat field(s) that carry a reply's thinking, on messages and stream deltas: reasoning_content (DeepSeek's and vLLM's older name), reasoning (vLLM's newer one) or both."""
    sleep_idle_seconds: list[str] = Field(default_factory=list)
    """Seconds a model may sit idle (nothing in flight, nothing arriving) before its engine sleeps, freeing its weights and KV cache; the next request wakes it (docs/sleep.md). N for every model or NAME=N for one (repeat the flag; a YAML list; env: separated by spaces); N from 0 (never) to a year (31622400). Empty: never."""
    kv_peers: list[str] = Field(default_factory=list)
    """Decode worker (--role decode): the prefill workers' KV transfer addresses, HOST:PORT (repeat the flag, or separate them with commas; a YAML list; env: separated by spaces or commas; at most 64). Each is checked at start (a different model, KV dtype or block size stops the start; one that does not answer is a warning), and a request may pull only from one of them. Empty: any the PD router names (docs/disaggregation.md)."""
    ui: bool = True
    """Serve the web console (chat playground and operator pages, docs/console.md) at / and /ui/; --no-ui leaves both out (404). The pages hold no data: what they show comes from the API, with the user's key."""

    @field_validator(
        "models",
        "lora_modules",
        "fallback",
        "allowed_hosts",
        "model_root",
        "reasoning_parser",
        "sleep_idle_seconds",
        "kv_peers",
        mode="before",
    )
    @classmethod
    def _split_words(cls, value: Any) -> Any:
        return value.split() if isinstance(value, str) else value

    @field_validator("allowed_hosts", mode="after")
    @classmethod
    def _split_hosts(cls, value: list[str]) -> list[str]:
        """One flag may name several hosts, space-separated, as the variable does (no host holds a space)."""
        return [host for item in value for host in item.split()]

    @field_validator("kv_peers", mode="after")
    @classmethod
    def _peers(cls, value: list[str]) -> list[str]:
        """HOST:PORT each, however they were separated."""
        return [f"{host}:{port}" if ":" not in host else f"[{host}]:{port}" for host, port in parse_peers(value)]

    @field_validator("reasoning_parser", mode="after")
    @classmethod
    def _parsers(cls, value: list[str]) -> list[str]:
        parse_parser_choices(value)
        return value

    @field_validator("sleep_idle_seconds", mode="before")
    @classmethod
    def _idle_words(cls, value: Any) -> Any:
        """A YAML number (sleep_idle_seconds: 600) is the one entry for every model."""
        return [str(value)] if isinstance(value, int | float) and not isinstance(value, bool) else value

    @field_validator("sleep_idle_seconds", mode="after")
    @classmethod
    def _idle_times(cls, value: list[str]) -> list[str]:
        parse_sleep_choices(value)
        return value

    @field_validator("embedding_model", mode="before")
    @classmethod
    def _embedding_folder(cls, value: Any) -> Any:
        """ "none" disables it (from the flag as from the environment); a path
        must be a folder, found out here rather than after the engine has loaded."""
        if not isinstance(value, str) or value == DEFAULT_EMBEDDING_MODEL:
            return value
        if value.strip().lower() in ("none", "null", ""):
            return None
        if not os.path.isdir(value):
            raise ValueError(
                f"no such folder: expected {DEFAULT_EMBEDDING_MODEL} (bundled), a sentence-transformers "
                "folder, or none (or --no-embedding-model)"
            )
        return value


def parse_peer(text: str) -> tuple[str, int]:
    """HOST:PORT (an IPv6 host in brackets, [::1]:8998) as (host, port); ValueError naming what is wrong."""
    host, sep, port = text.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{text!r} is not HOST:PORT (a prefill worker's KV transfer address, port 1-65535)")
    return host, int(port)


def parse_peers(values: list[str]) -> list[tuple[str, int]]:
    """Every HOST:PORT of --kv-peers (repeated, or comma- or space-separated), at most MAX_KV_PEERS."""
    peers = [parse_peer(item) for value in values for item in value.replace(",", " ").split()]
    if len(peers) > MAX_KV_PEERS:
        raise ValueError(f"{len(peers)} peers; at most {MAX_KV_PEERS} are accepted")
    return peers


def field_docs(cls: type[BaseModel]) -> dict[str, str]:
    """Attribute docstrings of a class body, the way pydantic's use_attribute_docstrings reads them."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not (isinstance(klass, type) and issubclass(klass, BaseModel)) or klass is BaseModel:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _base_type(annotation: Any) -> tuple[Any, bool]:
    """(the non-None type, whether None is allowed)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else str), len(rest) < len(args)
    return annotation, False


def _none_or(convert: Any, nullable: bool) -> Any:
    def parse(text: str) -> Any:
        if nullable and text.lower() in ("none", "null", ""):
            return None
        return convert(text)

    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


def add_model_options(
    parser: argparse.ArgumentParser, cls: type[BaseModel], title: str, skip: tuple[str, ...] = ()
) -> None:
    group = parser.add_argument_group(title)
    docs = field_docs(cls)
    for name, info in cls.model_fields.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        kind, nullable = _base_type(info.annotation)
        default = info.get_default(call_default_factory=True)
        help_text = f"{docs.get(name, '')} (default: {default}; env STOKER_{name.upper()})"
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        elif typing.get_origin(kind) is Literal:
            group.add_argument(flag, choices=typing.get_args(kind), default=argparse.SUPPRESS, help=help_text)
        elif typing.get_origin(kind) is list:  # repeat the flag for each value
            group.add_argument(flag, action="append", default=argparse.SUPPRESS, metavar=name.upper(), help=help_text)
        else:
            convert = kind if kind in (int, float) else str
            group.add_argument(
                flag, type=_none_or(convert, nullable), default=argparse.SUPPRESS, metavar=name.upper(), help=help_text
            )


def env_values(cls: type[BaseModel], environ: dict[str, str] | None = None) -> dict[str, Any]:
    """STOKER_<FIELD> variables as raw strings (pydantic converts them; "none" means None)."""
    environ = dict(os.environ) if environ is None else environ
    values: dict[str, Any] = {}
    for name, info in cls.model_fields.items():
        raw = environ.get(f"STOKER_{name.upper()}")
        if raw is None:
            continue
        _, nullable = _base_type(info.annotation)
        values[name] = None if nullable and raw.lower() in ("none", "null", "") else raw
    return values


def build(
    cls: type[BaseModel],
    yaml_values: dict[str, Any],
    args: argparse.Namespace,
    environ: dict[str, str] | None = None,
    skip: tuple[str, ...] = (),
) -> BaseModel:
    """Merge the three sources for the fields cls knows, in precedence order."""
    fields = {k for k in cls.model_fields if k not in skip}
    values: dict[str, Any] = {k: v for k, v in yaml_values.items() if k in fields}
    values.update({k: v for k, v in env_values(cls, environ).items() if k in fields})
    values.update({k: v for k, v in vars(args).items() if k in fields})
    return cls.model_validate(values)


def load_yaml(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of option names to values")
    return {str(k).replace("-", "_"): v for k, v in data.items()}

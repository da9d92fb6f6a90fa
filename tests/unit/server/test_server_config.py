"""`stoker serve` options: every config field is an option, with help; CLI >
environment > YAML > defaults."""

from __future__ import annotations

import os
import time

import pytest

from stoker.cli import build_parser
from stoker.config import EngineConfig
from stoker.control.settings import ControlSettings
from stoker.server.cli import resolve_configs, resolve_extension_settings
from stoker.server.config import EXTENSION_SKIP, ServerConfig, field_docs


def parse(argv: list[str]):
    return build_parser().parse_args(["serve", *argv])


def test_help_documents_every_field(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--help"])
    text = capsys.readouterr().out
    for cls in (EngineConfig, ServerConfig, ControlSettings):
        docs = field_docs(cls)
        for name in cls.model_fields:
            if name in EXTENSION_SKIP["control_config"]:
                continue
            assert "--" + name.replace("_", "-") in text
            assert docs.get(name), f"{cls.__name__}.{name} has no docstring"
    assert "--no-embedding-model" in text and "--config" in text


def test_precedence(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "stoker.yaml"
    config.write_text("port: 9000\nmax-num-seqs: 8\nshutdown_timeout: 5\nhost: 0.0.0.0\nembedding_model: null\n")
    monkeypatch.setenv("STOKER_PORT", "9100")
    monkeypatch.setenv("STOKER_MAX_NUM_SEQS", "12")
    monkeypatch.setenv("STOKER_ENABLE_PREFIX_CACHING", "false")
    engine, server = resolve_configs(parse(["--config", str(config), "--port", "9200", "m.gguf"]))
    assert server.port == 9200 and engine.max_num_seqs == 12 and server.shutdown_timeout == 5
    assert server.host == "0.0.0.0" and server.embedding_model is None
    assert engine.model == "m.gguf" and engine.enable_prefix_caching is False


def test_defaults_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(__import__("os").environ):
        if key.startswith("STOKER_"):
            monkeypatch.delenv(key)
    engine, server = resolve_configs(parse([]))
    assert (server.host, server.port, server.shutdown_timeout) == ("127.0.0.1", 8000, 30.0)
    assert server.embedding_model == "all-MiniLM-L6-v2" and engine.model is None
    _, server = resolve_configs(parse(["--no-embedding-model", "--no-enable-prefix-caching"]))
    assert server.embedding_model is None


def test_bad_values_are_reported(tmp_path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("prot: 1\n")
    with pytest.raises(ValueError, match="prot"):
        resolve_configs(parse(["--config", str(config)]))
    with pytest.raises(ValueError):
        resolve_configs(parse(["--port", "70000"]))


def test_control_settings_are_serve_options(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "stoker.yaml"
    config.write_text("db: /yaml.db\nmax-queued-requests: 7\nmetrics_require_auth: true\nmax_queued_tokens: 9\n")
    monkeypatch.setenv("STOKER_MAX_QUEUED_REQUESTS", "8")
    monkeypatch.setenv("STOKER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    monkeypatch.delenv("STOKER_DB", raising=False)
    args = parse(
        [
            "--config",
            str(config),
            "--require-auth",
            "--max-queued-tokens",
            "10",
            "--max-queue-wait",
            "5",
            "--metrics-per-key",
        ]
    )
    control = resolve_extension_settings(args)["control_config"]
    assert isinstance(control, ControlSettings)
    assert control.db == "/yaml.db" and control.max_queued_requests == 8 and control.max_queued_tokens == 10
    assert control.require_auth and control.metrics_require_auth and control.metrics_per_key
    assert control.otlp_endpoint == "http://127.0.0.1:4318" and control.max_queue_wait == 5
    with pytest.raises(ValueError, match="max_queued_requests"):
        resolve_extension_settings(parse(["--max-queued-requests", "0"]))
    config.write_text("model_name: x\n")  # set by the server, not an option
    with pytest.raises(ValueError, match="model_name"):
        resolve_configs(parse(["--config", str(config)]))


def test_require_auth_without_keys_exits_2_with_a_message(tmp_path) -> None:
    import subprocess
    import sys

    from conftest import FAKE_CORE, REPO, TESTS_DIR

    db = tmp_path / "empty.db"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stoker.cli",
            "serve",
            "--engine-core",
            FAKE_CORE,
            "--no-embedding-model",
            "--port",
            "0",
            "--db",
            str(db),
            "--require-auth",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": f"{TESTS_DIR}:{REPO}"},
        start_new_session=True,
    )
    _, stderr = server.communicate(timeout=60)
    assert server.returncode == 2, stderr
    assert "--require-auth" in stderr and "stoker keys create" in stderr
    assert "Traceback" not in stderr
    # The engine process it prestarted while it read its settings ends with it
    # (and multiprocessing's resource tracker a moment after it).
    deadline = time.monotonic() + 10
    while _group_alive(server.pid):
        assert time.monotonic() < deadline, "a process of the refused server outlived it by 10 s"
        time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_models_and_fallbacks_from_flags_yaml_and_env(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "stoker.yaml"
    config.write_text("models:\n  - big=/m/big.gguf\nfallback: [big=small]\nmax_model_memory: 8GiB\n")
    _, server = resolve_configs(parse(["--config", str(config)]))
    assert server.models == ["big=/m/big.gguf"] and server.fallback == ["big=small"]
    assert server.max_model_memory == 8 * 1024**3
    _, server = resolve_configs(parse(["--model", "a=/x.gguf", "--model", "b=/y.gguf", "--fallback", "a=b"]))
    assert server.models == ["a=/x.gguf", "b=/y.gguf"] and server.fallback == ["a=b"]
    monkeypatch.setenv("STOKER_MODELS", "a=/x.gguf b=/y.gguf")
    _, server = resolve_configs(parse([]))
    assert server.models == ["a=/x.gguf", "b=/y.gguf"]


def test_the_collector_is_on_once_the_server_runs_and_after_a_refused_start(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`stoker serve` builds its app with the garbage collector off (its imports make
    objects to walk, not garbage), and switches it back on before it answers anyone."""
    import gc

    import uvicorn

    from stoker.server.cli import run

    seen: list[bool] = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: seen.append(gc.isenabled()))
    monkeypatch.setenv("STOKER_DB", str(tmp_path / "keys.db"))
    served = parse(["--engine-core", "server_fakes:FakeEngineCore", "--no-embedding-model", "--port", "0"])
    assert run(served) == 0 and seen == [True] and gc.isenabled()
    refused = parse(["--engine-core", "server_fakes:FakeEngineCore", "--kv-peers", "127.0.0.1:1"])
    assert run(refused) == 2 and gc.isenabled()

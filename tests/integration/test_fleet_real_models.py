"""Two chat models and the embedding model served at once by one `stoker serve`
on real engines: the default model and a tiny random-weight GGUF, each in its
own engine process. The official openai client lists and uses them; a key
limited to one model cannot use the other (and is not served by it as a
fallback); metrics are per model; the default model's fallback is the tiny
one, and a key allowed only the default model is refused rather than
silently served by the tiny one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from conftest import REPO, TESTS_DIR, ServerProcess, auth, poll_until, start_server

from stoker.bench.synthetic_gguf import LlamaShape, write_llama_gguf
from stoker.config import default_model_path
from stoker.models.quant.kernels import quant_isa

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
TINY = LlamaShape(hidden=256, intermediate=512, layers=1, heads=4, kv_heads=2, vocab=300, context=256)
SMALL_ARGS = ["--num-kv-blocks", "64", "--max-num-seqs", "4", "--max-model-len", "256", "--num-threads", "1"]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, str]]:
    folder = tmp_path_factory.mktemp("fleet-real")
    tiny = write_llama_gguf(folder / "tiny.gguf", TINY, name="tiny")
    db = str(folder / "keys.db")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS_DIR, REPO]), "STOKER_DB": db}
    created = subprocess.run(
        [
            sys.executable,
            "-m",
            "stoker.cli",
            "keys",
            "create",
            "--name",
            "smol-only",
            "--models",
            "smol,all-MiniLM-L6-v2",
            # /metrics below takes the metrics scope
            "--scope",
            "inference",
            "--scope",
            "metrics",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    secret = json.loads(created.stdout)["secret"]
    server = start_server(
        [*SMALL_ARGS, "--model", f"smol={default_model_path()}", "--model", f"tiny={tiny}", "--fallback", "smol=tiny"],
        str(folder),
        env={"STOKER_DB": db},
        ready_timeout=200,
    )
    try:
        yield server, secret
    finally:
        server.stop()


def test_two_chat_models_and_embeddings_answer(served: tuple[ServerProcess, str]) -> None:
    server, secret = served
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=secret, max_retries=0)
    admin = httpx.get(f"{server.url}/admin/models", headers=auth(secret))
    assert admin.status_code == 403  # an inference key is no operator
    listed = [m.id for m in client.models.list().data]
    assert listed == ["smol", "tiny", "all-MiniLM-L6-v2"]
    reply = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0
    )
    assert reply.model == "smol" and reply.choices[0].message.content
    with pytest.raises(openai.PermissionDeniedError) as refused:
        client.completions.create(model="tiny", prompt="x", max_tokens=4)  # tiny has no chat template
    assert refused.value.body["code"] == "model_not_allowed"  # type: ignore[index]
    embedded = client.embeddings.create(model="all-MiniLM-L6-v2", input=["a", "b"])
    assert len(embedded.data) == 2 and len(embedded.data[0].embedding) == 384


def test_each_model_has_its_own_engine_and_metrics(served: tuple[ServerProcess, str]) -> None:
    server, secret = served
    open_client = httpx.Client(base_url=server.url, headers=auth(secret), timeout=60)
    body = {"model": "smol", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    assert open_client.post("/v1/completions", json=body).status_code == 200
    ready = httpx.get(f"{server.url}/ready", headers=auth(secret)).json()
    assert set(ready["models"]) == {"smol", "tiny"} and all(m["ready"] for m in ready["models"].values())
    # The engines' stats reach /metrics with the next tick of a 0.25 s feed.
    wanted = ('vllm:generation_tokens_total{model_name="smol"}', 'vllm:kv_cache_usage_perc{model_name="tiny"}')
    metrics = poll_until(
        lambda: httpx.get(f"{server.url}/metrics", headers=auth(secret)).text,
        lambda text: all(series in text for series in wanted),
        5,
    )
    assert wanted[0] in metrics
    assert wanted[1] in metrics
    # the int8 kernels' path, as the engine chose it, beside the file it serves
    isa = quant_isa()
    smol_info = next(
        line
        for line in metrics.splitlines()
        if line.startswith("stoker:model_version_info{") and 'model_name="smol"' in line
    )
    assert f'quantized_matmul="{isa}"' in smol_info and smol_info.endswith(" 1.0"), smol_info


def test_a_key_without_the_fallback_model_is_not_served_by_it(served: tuple[ServerProcess, str]) -> None:
    server, secret = served
    listing = httpx.get(f"{server.url}/v1/models", headers=auth(secret)).json()["data"]
    assert listing[0]["digest"].startswith("sha256:")
    # The key may use smol only: with smol's engine gone, it gets smol's 503, not tiny's answer.
    pid = httpx.get(f"{server.url}/ready", headers=auth(secret)).json()["engine_pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while httpx.get(f"{server.url}/ready", headers=auth(secret)).json()["models"]["smol"]["ready"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    body = {"model": "smol", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    refused = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=auth(secret), timeout=30)
    assert refused.status_code == 503, refused.text
    assert "Retry-After" in refused.headers

"""LoRA adapters served as models by a real server (tiny random-weight Llama,
random-weight PEFT adapters from tests/tiny_loras.py): the official openai
client names an adapter in `model` and gets that adapter's greedy output (the
LLM API's with lora_name, not the base's); /v1/models lists adapters with
parent and root; keys' allow-lists treat an adapter as a model; operators load
and unload adapters at run time (vLLM's endpoints, /admin/models); every bad
adapter is a 400 naming it and the reason and changes nothing; an unload lets
a stream in flight finish; a refused adapter stops the start in one line."""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from conftest import REPO, ServerProcess, start_server
from tiny_loras import ALL_MODULES, ATTENTION, MLP, make_peft_adapter
from tiny_models import make_tiny_hf_model

from stoker.control.db import open_db
from stoker.control.keys import KeyStore
from stoker.server.fleet import FleetError, ModelSpec
from stoker.server.lora import adapter_digest, parse_lora_module, plan_adapters

PROMPT = "The quick brown fox"
MAX_LORA_RANK = 16
Tensors = dict[str, torch.Tensor]
KEYS: dict[str, str] = {}
"""Secrets by role: admin, adapter_only (may use sql alone), base_only (tiny alone), inference (any model)."""


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The base and its adapters, all in one folder: the server's --model-root by default."""
    root = tmp_path_factory.mktemp("lora-models")
    base = make_tiny_hf_model("llama", root)
    found = {
        "base": base,
        "sql": make_peft_adapter(base, root / "sql", rank=4, targets=ALL_MODULES, seed=1, magnitude=0.5),
        "chat": make_peft_adapter(base, root / "chat", rank=8, targets=ATTENTION, seed=2, magnitude=0.5),
        "mlp": make_peft_adapter(base, root / "mlp", rank=16, targets=MLP, seed=3, magnitude=0.5),
    }
    found["wide"] = _widened(found["sql"], root / "wide", 2 * MAX_LORA_RANK)
    found["corrupt"] = _copy(found["chat"], root / "corrupt")
    (found["corrupt"] / "adapter_model.safetensors").write_bytes(b"\x00not a safetensors file" * 10)
    found["pickled"] = _copy(found["chat"], root / "pickled")
    (found["pickled"] / "adapter_model.safetensors").rename(found["pickled"] / "adapter_model.bin")
    found["alien"] = _reshaped(found["chat"], root / "alien")
    found["renamed"] = _renamed_module(found["chat"], root / "renamed")
    return found


def _copy(folder: Path, to: Path) -> Path:
    shutil.copytree(folder, to)
    return to


def _rewrite(folder: Path, to: Path, change: Callable[[Tensors], Tensors]) -> Path:
    from safetensors.torch import load_file, save_file

    _copy(folder, to)
    save_file(change(load_file(to / "adapter_model.safetensors")), to / "adapter_model.safetensors")
    return to


def _widened(folder: Path, to: Path, rank: int) -> Path:
    """The adapter at a higher rank (zero rows and columns added: the same update)."""

    def pad(tensors: Tensors) -> Tensors:
        out = {}
        for name, t in tensors.items():
            grown = (rank - t.shape[0], t.shape[1]) if "lora_A" in name else (t.shape[0], rank - t.shape[1])
            out[name] = torch.cat([t, torch.zeros(grown)], dim=0 if "lora_A" in name else 1)
        return out

    _rewrite(folder, to, pad)
    config = json.loads((to / "adapter_config.json").read_text())
    (to / "adapter_config.json").write_text(json.dumps({**config, "r": rank}))
    return to


def _reshaped(folder: Path, to: Path) -> Path:
    """An adapter of another base: its first A matrix reads a wider hidden state."""

    def widen(tensors: Tensors) -> Tensors:
        name = next(k for k in sorted(tensors) if "lora_A" in k)
        rank, width = tensors[name].shape
        return {**tensors, name: torch.randn(rank, width + 8)}

    return _rewrite(folder, to, widen)


def _renamed_module(folder: Path, to: Path) -> Path:
    """An adapter naming a module a Llama layer does not have."""
    return _rewrite(folder, to, lambda t: {k.replace("q_proj", "qkv_fused"): v for k, v in t.items()})


@pytest.fixture(scope="module")
def server(files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("lora-server")
    db = str(tmp / "keys.db")
    store = KeyStore(open_db(db))
    KEYS["admin"] = store.create("root", admin=True)[1]
    KEYS["adapter_only"] = store.create("sql-team", models=["sql"])[1]
    KEYS["base_only"] = store.create("base-team", models=["tiny"])[1]
    KEYS["inference"] = store.create("anyone")[1]
    args = [
        *(
            "--model",
            f"tiny={files['base']}",
            "--lora-modules",
            f"sql={files['sql']}@{adapter_digest(str(files['sql']))}",
        ),
        *("--lora-modules", f"tiny:chat={files['chat']}", "--fallback", "sql=tiny"),
        *("--max-lora-rank", str(MAX_LORA_RANK), "--max-loras", "2", "--max-loaded-loras", "2"),
        *("--no-embedding-model", "--max-model-len", "256", "--max-num-seqs", "8"),
    ]
    process = start_server(args, str(tmp), env={"STOKER_DB": db}, ready_timeout=300)
    process.key = KEYS["admin"]
    try:
        yield process
    finally:
        process.stop()


def client(server: ServerProcess, role: str = "admin") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS[role], max_retries=0)


def complete(server: ServerProcess, model: str, role: str = "admin") -> str:
    answer = client(server, role).completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert answer.model == model
    return answer.choices[0].text


def post(server: ServerProcess, path: str, body: dict[str, object], role: str | None = "admin") -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEYS[role]}"} if role else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=120)


def listed(server: ServerProcess, role: str = "admin") -> dict[str, dict[str, object]]:
    data = client(server, role).models.list().data
    return {m.id: m.model_dump() for m in data}


# ---- the flag, without a server ----------------------------------------------------


def test_lora_modules_name_their_base_in_a_fleet(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    specs = [ModelSpec("big:v2", str(tmp_path)), ModelSpec("small", str(tmp_path))]
    spec = parse_lora_module(f"big:v2:sql:x={tmp_path / 'a'}@sha256:{'AB' * 32}", [s.name for s in specs])
    assert (spec.base, spec.name, spec.digest) == ("big:v2", "sql:x", "sha256:" + "ab" * 32)
    with pytest.raises(FleetError, match=r"name the adapter's base model, one of big:v2, small"):
        plan_adapters([f"sql={tmp_path / 'a'}"], specs)
    with pytest.raises(FleetError, match=r"the name 'small' is taken by another model or adapter"):
        plan_adapters([f"big:v2:small={tmp_path / 'a'}"], specs)
    with pytest.raises(FleetError, match=r"no adapter at .*nowhere"):
        plan_adapters([f"small:x={tmp_path / 'nowhere'}"], specs)


# ---- serving -------------------------------------------------------------------------


def test_an_adapter_answers_as_the_llm_api_with_its_lora_name(server: ServerProcess, files: dict[str, Path]) -> None:
    from stoker.engine.llm import LLM
    from stoker.engine.params import SamplingParams

    served = {name: complete(server, name) for name in ("tiny", "sql", "chat")}
    assert len(set(served.values())) == 3, served  # each adapter changes the output
    llm = LLM(str(files["base"]), max_model_len=256)
    for name in ("sql", "chat"):
        llm.add_lora(name, str(files[name]))
    params = SamplingParams(max_tokens=12, temperature=0.0)
    for name, text in served.items():
        [reference] = llm.generate([PROMPT], params, lora_name=None if name == "tiny" else name)
        assert reference.outputs[0].text == text, name


def test_models_lists_adapters_with_parent_and_root(server: ServerProcess, files: dict[str, Path]) -> None:
    seen = listed(server)
    assert list(seen)[:3] == ["tiny", "sql", "chat"]
    sql = seen["sql"]
    assert sql["parent"] == "tiny" and sql["root"] == str(files["sql"]) and sql["owned_by"] == seen["tiny"]["owned_by"]
    assert sql["digest"] == adapter_digest(str(files["sql"]))
    assert listed(server, "inference")["sql"]["root"] == "sql"  # paths are for admin keys only
    one = client(server).models.retrieve("chat")
    assert one.model_dump()["parent"] == "tiny"
    models = httpx.get(f"{server.url}/admin/models", headers=server.headers()).json()["data"]
    adapters = {a["name"]: a for a in models[0]["adapters"]}
    assert adapters["sql"]["rank"] == 4 and adapters["chat"]["target_modules"] == sorted(ATTENTION)
    assert adapters["sql"]["status"] == "serving" and adapters["sql"]["memory_bytes"] > 0


def test_keys_allow_adapters_and_bases_apart(server: ServerProcess) -> None:
    assert complete(server, "sql", "adapter_only")
    assert complete(server, "tiny", "base_only")
    for role, model in (("adapter_only", "tiny"), ("adapter_only", "chat"), ("base_only", "sql")):
        with pytest.raises(openai.PermissionDeniedError, match="may not use the model"):
            complete(server, model, role)
    metrics = httpx.get(f"{server.url}/metrics", headers=server.headers()).text
    assert 'vllm:request_success_total{finished_reason="length",model_name="sql"}' in metrics
    # The ledger writes its rows every second: read until they are there (10 s at most).
    deadline = time.monotonic() + 10
    while True:
        rows = sqlite3.connect(server_db(server)).execute("SELECT DISTINCT model FROM stoker_usage").fetchall()
        if {"sql", "chat", "tiny"} <= {row[0] for row in rows} or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert {"sql", "chat", "tiny"} <= {row[0] for row in rows}
    metrics = httpx.get(f"{server.url}/metrics", headers=server.headers()).text
    assert 'stoker:lora_loads_total{model_name="tiny"}' in metrics
    assert "vllm:lora_requests_info{" in metrics and 'max_lora="2"' in metrics


def server_db(server: ServerProcess) -> str:
    log = Path(server.log_path)
    return str(log.parent / "keys.db")


# ---- run time ----------------------------------------------------------------------


def test_operators_load_and_unload_adapters(server: ServerProcess, files: dict[str, Path]) -> None:
    body = {"lora_name": "mlp", "lora_path": str(files["mlp"])}
    assert post(server, "/v1/load_lora_adapter", body, role=None).status_code == 401
    assert post(server, "/v1/load_lora_adapter", body, role="inference").status_code == 403
    loaded = post(server, "/v1/load_lora_adapter", body)
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'mlp' added successfully."
    assert listed(server)["mlp"]["parent"] == "tiny"
    assert complete(server, "mlp") not in (complete(server, "tiny"), complete(server, "sql"))
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "mlp"}, role="inference").status_code == 403
    gone = post(server, "/v1/unload_lora_adapter", {"lora_name": "mlp"})
    assert gone.status_code == 200 and gone.text == "Success: LoRA adapter 'mlp' removed successfully."
    with pytest.raises(openai.NotFoundError):
        complete(server, "mlp")
    missing = post(server, "/v1/unload_lora_adapter", {"lora_name": "mlp"})
    assert missing.status_code == 404 and "adapter mlp is not" in missing.json()["error"]["message"]
    # The same through /admin/models and `stoker models`.
    admin = {"name": "mlp2", "path": str(files["mlp"]), "base": "tiny"}
    answer = httpx.post(f"{server.url}/admin/models", json=admin, headers=server.headers(), timeout=120)
    assert answer.status_code == 200 and answer.json()["rank"] == 16, answer.text
    assert [a["status"] for a in _adapters(server) if a["name"] == "mlp2"] == ["serving"]
    cli = [sys.executable, "-m", "stoker.cli", "models", "--url", server.url, "unload", "mlp2"]
    env = {"STOKER_API_KEY": KEYS["admin"], "PATH": "/usr/bin:/bin"}
    unloaded = subprocess.run(cli, capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert unloaded.returncode == 0 and '"unloaded": "adapter"' in unloaded.stdout, unloaded.stderr


BAD_ADAPTERS = [
    ("alien", "alien", {}, r"adapter alien: .*(shape|features|\[)"),
    ("wide", "wide", {}, rf"adapter wide: .*rank 32, above the maximum LoRA rank {MAX_LORA_RANK}"),
    ("renamed", "renamed", {}, r"adapter renamed: .*qkv_fused"),
    ("corrupt", "corrupt", {}, r"adapter corrupt: .*(corrupt|unreadable)"),
    ("missing", "nowhere", {}, r"adapter missing: no adapter at .*nowhere"),
    ("pickled", "pickled", {}, r"adapter pickled: adapter_model.bin is a pickle"),
    ("pinned", "mlp", {"digest": "sha256:" + "0" * 64}, r"adapter pinned: digest mismatch"),
    ("sql", "mlp", {}, r"adapter sql: the name is taken by an adapter"),
    ("tiny", "mlp", {}, r"adapter tiny: the name is taken by a model"),
    ("other", "mlp", {"base_model_name": "huge"}, r"adapter other: no model huge"),
]
"""(name, file, extra body, the reason the 400 gives): another base's shapes, a rank above
--max-lora-rank, a module Llama does not have, a corrupt, missing or pickled file, a digest mismatch,
a name taken, a base not served."""


def test_a_bad_adapter_is_a_400_naming_it_and_changes_nothing(server: ServerProcess, files: dict[str, Path]) -> None:
    before = listed(server)
    for name, file, extra, reason in BAD_ADAPTERS:
        path = files[file] if file in files else files["base"].parent / file
        answer = post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path), **extra})
        assert answer.status_code == 400, answer.text
        message = answer.json()["error"]["message"]
        assert "\n" not in message and re.search(reason, message), message
    assert listed(server) == before
    assert complete(server, "sql") == complete(server, "sql", "adapter_only")


def test_a_path_outside_the_model_roots_is_refused(server: ServerProcess) -> None:
    answer = post(server, "/v1/load_lora_adapter", {"lora_name": "etc", "lora_path": "/etc"})
    assert answer.status_code == 403 and "model root" in answer.json()["error"]["message"]


def test_an_unload_lets_a_stream_in_flight_finish(server: ServerProcess, files: dict[str, Path]) -> None:
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "brief", "lora_path": str(files["mlp"])}).is_success
    stream = client(server).chat.completions.create(
        model="brief",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=40,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    first = next(chunks)
    assert first.model == "brief"
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "brief"}).is_success
    with pytest.raises(openai.NotFoundError):  # new requests: at once
        complete(server, "brief")
    rest = list(chunks)
    assert rest[-1].choices[0].finish_reason == "length"
    deadline = time.monotonic() + 10
    while any(a["name"] == "brief" for a in _adapters(server)):
        assert time.monotonic() < deadline, "the adapter never left after its stream ended"
        time.sleep(0.1)


def _adapters(server: ServerProcess) -> list[dict[str, object]]:
    models = httpx.get(f"{server.url}/admin/models", headers=server.headers()).json()["data"]
    return [a for m in models for a in m["adapters"]]


def test_a_refused_adapter_stops_the_start_in_one_line(files: dict[str, Path], tmp_path: Path) -> None:
    command = [sys.executable, "-m", "stoker.cli", "serve", "--port", "0", "--no-embedding-model"]
    command += [str(files["base"]), "--max-model-len", "128", "--max-lora-rank", str(MAX_LORA_RANK)]
    env = {"STOKER_DB": str(tmp_path / "keys.db"), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    wide = subprocess.run(
        [*command, "--lora-modules", f"wide={files['wide']}"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    lines = [line for line in wide.stderr.splitlines() if line.startswith("stoker serve:")]
    assert wide.returncode == 1 and len(lines) == 1, wide.stderr[-3000:]
    assert lines[0].startswith("stoker serve: startup failed: adapter wide: ") and "rank 32" in lines[0]


def test_yaml_and_environment_name_adapters_too(files: dict[str, Path]) -> None:
    from stoker.server.config import ServerConfig, env_values

    entries = [f"a={files['sql']}", f"tiny:b={files['chat']}"]
    from_env = env_values(ServerConfig, {"STOKER_LORA_MODULES": " ".join(entries)})
    assert ServerConfig.model_validate(from_env).lora_modules == entries
    assert ServerConfig.model_validate({"lora_modules": entries}).lora_modules == entries


def test_a_pin_covers_the_adapters_config_not_only_its_weights(files: dict[str, Path], tmp_path: Path) -> None:
    # lora_alpha scales the update as much as the weights do: a pinned adapter whose config was
    # edited must not pass its pin. A README is no part of the arithmetic and may change.
    folder = tmp_path / "sql"
    shutil.copytree(files["sql"], folder)
    pinned = adapter_digest(str(folder))
    (folder / "README.md").write_text("edited model card\n")
    assert adapter_digest(str(folder)) == pinned
    config = json.loads((folder / "adapter_config.json").read_text())
    config["lora_alpha"] = config["lora_alpha"] * 4
    (folder / "adapter_config.json").write_text(json.dumps(config))
    assert adapter_digest(str(folder)) != pinned

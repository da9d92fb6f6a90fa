"""/admin/prefixes refusals, on the fake core: shut in open mode, admin keys only,
bodies checked after the key (a stranger learns nothing from a 400), a model
without a disk tier named as such (409), an unknown model 404. What a pin does
on a real engine is tests/integration/test_kv_disk_replicas.py's."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from conftest import FAKE_CORE, ServerProcess, auth, start_server

from stoker.control.db import open_db
from stoker.control.keys import KeyStore

KEYS: dict[str, str] = {}
PIN = {"label": "system-prompt", "prompt": "You are a helpful assistant."}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("pins-api")
    db = str(tmp / "keys.db")
    store = KeyStore(open_db(db))
    KEYS["admin"] = store.create("root", admin=True)[1]
    KEYS["inference"] = store.create("app")[1]
    store.engine.dispose()
    server = start_server(
        ["--engine-core", FAKE_CORE, "--no-embedding-model", "--max-model-len", "256"], str(tmp), {"STOKER_DB": db}
    )
    try:
        yield server
    finally:
        server.stop()


def call(
    server: ServerProcess, method: str, path: str = "", key: str | None = "admin", **kwargs: object
) -> httpx.Response:
    headers = auth(KEYS[key]) if key else {}
    return httpx.request(method, f"{server.url}/admin/prefixes{path}", headers=headers, timeout=30, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [("POST", "", PIN), ("POST", "", {"label": "../x"}), ("GET", "", None), ("DELETE", "/system-prompt", None)],
)
def test_open_mode_refuses_every_call(fake_server: ServerProcess, method: str, path: str, body: object) -> None:
    response = call(fake_server, method, path, key=None, json=body)
    assert response.status_code == 403, response.text
    assert "admin key" in response.json()["error"]["message"]


def test_only_an_admin_key_may_pin(keyed: ServerProcess) -> None:
    assert call(keyed, "POST", key=None, json=PIN).status_code == 401
    response = call(keyed, "POST", key="inference", json={"label": "../x"})
    assert response.status_code == 403, response.text


def test_a_model_without_a_disk_tier_is_named(keyed: ServerProcess) -> None:
    for method, path, body in (("POST", "", PIN), ("GET", "", None), ("DELETE", "/system-prompt", None)):
        response = call(keyed, method, path, json=body)
        assert response.status_code == 409, response.text
        assert "--kv-cache-disk" in response.json()["error"]["message"]


def test_an_unknown_model_is_404(keyed: ServerProcess) -> None:
    response = call(keyed, "POST", json={**PIN, "model": "nope"})
    assert response.status_code == 404 and "nope" in response.json()["error"]["message"]
    assert call(keyed, "GET", params={"model": "nope"}).status_code == 404


@pytest.mark.parametrize(
    "body",
    [
        {"label": "../etc", "prompt": "x"},
        {"label": "", "prompt": "x"},
        {"label": "a" * 65, "prompt": "x"},
        {"label": "ok"},
        {"label": "ok", "prompt": "x", "token_ids": [1, 2]},
        {"label": "ok", "prompt": ""},
        {"label": "ok", "token_ids": [-1]},
        {"label": "ok", "prompt": "x", "surprise": 1},
    ],
)
def test_bad_bodies_are_400(keyed: ServerProcess, body: dict[str, object]) -> None:
    response = call(keyed, "POST", json=body)
    assert response.status_code == 400, response.text

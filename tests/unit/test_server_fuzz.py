"""Schemathesis fuzzes every operation of the app's OpenAPI schema against a
real server process (fake engine core, no step delay); no input may cause a 500.
Bounded: a fixed number of examples per operation, no shrinking."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from conftest import FAKE_CORE, ServerProcess, start_server
from hypothesis import HealthCheck, Phase, settings

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    server = start_server(
        ["--engine-core", FAKE_CORE, "--no-embedding-model", "--max-model-len", "256"],
        str(tmp_path_factory.mktemp("fuzz")),
        env={"STOKER_FAKE_STEP_S": "0"},
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server: ServerProcess):
    return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")
STATUS: list[tuple[str, int]] = []


@schema.parametrize()
@settings(
    max_examples=40, deadline=None, phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck)
)
def test_no_input_causes_a_500(case: schemathesis.Case, fuzz_server: ServerProcess) -> None:
    response = case.call(base_url=fuzz_server.url, timeout=30)
    STATUS.append((case.path, response.status_code))
    assert response.status_code < 500, f"{case.method} {case.path} {case.body!r}: {response.text}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}


def test_server_still_healthy(fuzz_server: ServerProcess) -> None:
    assert httpx.get(f"{fuzz_server.url}/ready").status_code == 200


def test_fuzz_reached_the_endpoints() -> None:
    """Guard against a fuzz run that only ever hit validation errors."""
    ok = {path for path, status in STATUS if status == 200}
    assert {"/v1/chat/completions", "/v1/completions", "/tokenize"} <= ok, sorted(set(STATUS))

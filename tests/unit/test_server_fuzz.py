"""Outside-in fuzzing: the pinned schemathesis CLI runs against a live server
(fake engine core, no step delay) from its own /openapi.json, authenticated
with an admin key so /admin/* is fuzzed too. No input may cause a server
error. Bounded: --max-time and a few examples per operation, no shrinking.

Only the CLI and its JUnit report are used (no pytest plugin, nothing private),
so a newer pytest or schemathesis cannot break the harness itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import FAKE_CORE, REPO, TESTS_DIR, ServerProcess, auth, start_server

pytestmark = pytest.mark.timeout(400)

FUZZ_SECONDS = 30  # the suite must stay under 15 minutes on 2 cores; max-examples per operation bounds it too
# Beyond "no 5xx": every status the server answers is one /openapi.json
# documents, bodies it refuses by schema are refused (booleans for integers
# were taken), and a method a path does not serve is a 405 naming the ones it
# does; answers, streamed events included, fit their documented schema.
# Not positive_data_acceptance: a schema cannot state every rule (a
# prompt plus max_tokens beyond the context is a 400 with a message).
CHECKS = ",".join(
    (
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "negative_data_rejection",
        "unsupported_method",
        "allow_header_conformance",
        "response_schema_conformance",
    )
)
# A 504 is the answer to the client's own `timeout` (fuzzed down to 5e-324 s)
# passing before the request could run: documented, and not a server fault.
CONFIG = """
[checks.not_a_server_error]
expected-statuses = ["2xx", "3xx", "4xx", "504"]
"""


def schemathesis_cli() -> list[str]:
    exe = shutil.which("st", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "schemathesis.cli"]


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, str, Path]]:
    tmp = tmp_path_factory.mktemp("fuzz")
    env = {**os.environ, "STOKER_DB": str(tmp / "keys.db"), "PYTHONPATH": os.pathsep.join([TESTS_DIR, REPO])}
    created = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "keys", "create", "--name", "fuzz", "--admin", "--json"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        cwd=REPO,
    )
    secret = json.loads(created.stdout)["secret"]
    server = start_server(
        ["--engine-core", FAKE_CORE, "--no-embedding-model", "--max-model-len", "256"],
        str(tmp),
        env={"STOKER_FAKE_STEP_S": "0", "STOKER_DB": str(tmp / "keys.db")},
    )
    try:
        yield server, secret, tmp
    finally:
        server.stop()


@pytest.fixture(scope="module")
def report(fuzzed: tuple[ServerProcess, str, Path]) -> ET.Element:
    server, secret, tmp = fuzzed
    (tmp / "schemathesis.toml").write_text(CONFIG)
    junit = tmp / "junit.xml"
    command = [
        *schemathesis_cli(),
        "--config-file",
        str(tmp / "schemathesis.toml"),
        "run",
        f"{server.url}/openapi.json",
        "-H",
        f"Authorization: Bearer {secret}",
        "--checks",
        CHECKS,
        "--max-examples",
        "25",
        "--max-time",
        str(FUZZ_SECONDS),
        "--workers",
        "1",
        "--no-shrink",
        "--seed",
        "16",
        "--request-timeout",
        "30",
        "--suppress-health-check",
        "all",
        "--report",
        "junit",
        "--report-junit-path",
        str(junit),
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=FUZZ_SECONDS + 120, cwd=tmp)
    (tmp / "schemathesis.out").write_text(run.stdout + run.stderr)
    assert junit.exists(), f"no report (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    root = ET.parse(junit).getroot()
    failures = [
        f"{case.get('name')}: {(problem.text or '')[:1500]}"
        for case in root.iter("testcase")
        for problem in (*case.findall("failure"), *case.findall("error"))
    ]
    assert not failures, "\n\n".join(failures)
    assert run.returncode == 0, run.stdout[-3000:]
    return root


def test_no_operation_causes_a_server_error(report: ET.Element) -> None:
    operations = {case.get("name") for case in report.iter("testcase")}
    for op in (
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "POST /tokenize",
        "POST /detokenize",
        "POST /admin/keys",
        "GET /admin/keys",
        "DELETE /admin/keys/{key_id}",
    ):
        assert op in operations, sorted(operations)


def test_fuzz_reached_the_endpoints_and_the_server_survived(
    report: ET.Element, fuzzed: tuple[ServerProcess, str, Path]
) -> None:
    server, secret, _ = fuzzed
    assert httpx.get(f"{server.url}/ready").status_code == 200
    # Every request the fuzzer made has a log line: most schema-valid bodies must
    # have been served, not only refused by validation.
    status: dict[str, Counter[int]] = {}
    for line in server.log().splitlines():
        if line.startswith("{") and '"event":"request"' in line:
            entry = json.loads(line)
            status.setdefault(entry["path"], Counter())[entry["status"]] += 1
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize"):
        assert status.get(path, Counter())[200] > 0, status
    assert "Traceback" not in server.log()
    # The admin key still works (the fuzzer never revoked or broke it).
    keys = httpx.get(f"{server.url}/admin/keys", headers=auth(secret))
    assert keys.status_code == 200

"""Outside-in fuzzing: the pinned schemathesis CLI runs against a live server
(fake engine core, no step delay) from its own /openapi.json, authenticated
with an admin key so /admin/* is fuzzed too: every operation, then a
stateful run along the schema's links (keys and stored responses created,
read, revoked or deleted). No input may cause a server error. Bounded:
--max-time and a few examples per operation, no shrinking.

Only the CLI and its JUnit report are used (no pytest plugin, nothing private),
so a newer pytest or schemathesis cannot break the harness itself.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import FAKE_CORE, REPO, TESTS_DIR, ServerProcess, auth, start_server

pytestmark = pytest.mark.timeout(400)

FUZZ_SECONDS = 30  # the suite must stay under 15 minutes on 2 cores; max-examples per operation bounds it too
STATEFUL_SECONDS = 10  # per family of created things (keys, stored responses)
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
# A 504 is the answer to the client's own `timeout` (fuzzed down to its
# minimum, 1 ms) passing before the request could run: documented, and not a
# server fault. A body the schema refuses may be so large (lists past their
# maxItems) that it is a 413 before it is parsed: a refusal too.
CONFIG = """
[checks.not_a_server_error]
expected-statuses = ["2xx", "3xx", "4xx", "504"]

[checks.negative_data_rejection]
expected-statuses = [400, 401, 403, 404, 405, 406, 409, 413, 415, 422, 428, 429]
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


def schemathesis(
    fuzzed: tuple[ServerProcess, str, Path], name: str, config: str, args: list[str], seconds: int
) -> tuple[ET.Element, str]:
    """One bounded CLI run; its JUnit report (no failure in it) and its output."""
    server, secret, tmp = fuzzed
    (tmp / f"{name}.toml").write_text(config)
    junit = tmp / f"{name}.xml"
    command = [
        *schemathesis_cli(),
        "--config-file",
        str(tmp / f"{name}.toml"),
        "run",
        f"{server.url}/openapi.json",
        "-H",
        f"Authorization: Bearer {secret}",
        *args,
        "--max-time",
        str(seconds),
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
    run = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 120, cwd=tmp)
    output = run.stdout + run.stderr
    (tmp / f"{name}.out").write_text(output)
    assert junit.exists(), f"no report (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    root = ET.parse(junit).getroot()
    failures = [
        f"{case.get('name')}: {(problem.text or '')[:1500]}"
        for case in root.iter("testcase")
        for problem in (*case.findall("failure"), *case.findall("error"))
    ]
    assert not failures, "\n\n".join(failures)
    assert run.returncode == 0, output[-3000:]
    return root, output


@pytest.fixture(scope="module")
def report(fuzzed: tuple[ServerProcess, str, Path]) -> ET.Element:
    args = ["--phases", "examples,coverage,fuzzing", "--checks", CHECKS, "--max-examples", "25"]
    return schemathesis(fuzzed, "fuzz", CONFIG, args, FUZZ_SECONDS)[0]


# The stateful phase follows /openapi.json's links only (none inferred), one
# family of created things per run so each gets its share of the time.
# use_after_free and ensure_resource_availability are not asked of it: a
# revoked key stays readable (its usage, its revocation time) by design, and
# a response created with "store": false is never stored; what the links
# must give is checked from the server's log below.
STATEFUL_CONFIG = (
    CONFIG
    + """
[phases.stateful.inference]
algorithms = []
"""
)
STATEFUL_CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
STATEFUL_FAMILIES = {"keys": ("^/admin/keys", 2), "responses": ("^/v1/responses", 3)}


@pytest.fixture(scope="module")
def stateful(report: ET.Element, fuzzed: tuple[ServerProcess, str, Path]) -> dict[str, tuple[int, int]]:
    """Links covered and declared, per family (after the fuzz run: one server, one run at a time)."""
    covered: dict[str, tuple[int, int]] = {}
    for family, (paths, _) in STATEFUL_FAMILIES.items():
        args = ["--phases", "stateful", "--include-path-regex", paths, "--checks", STATEFUL_CHECKS]
        _, output = schemathesis(fuzzed, f"stateful-{family}", STATEFUL_CONFIG, args, STATEFUL_SECONDS)
        links = re.search(r"API Links:\s+(\d+) covered / (\d+) selected", output)
        assert links, output[-3000:]
        covered[family] = (int(links.group(1)), int(links.group(2)))
    return covered


def request_lines(server: ServerProcess) -> list[dict[str, Any]]:
    return [
        json.loads(line) for line in server.log().splitlines() if line.startswith("{") and '"event":"request"' in line
    ]


def test_no_operation_causes_a_server_error(report: ET.Element, fuzzed: tuple[ServerProcess, str, Path]) -> None:
    server, secret, _ = fuzzed
    schema = httpx.get(f"{server.url}/openapi.json", headers=auth(secret)).json()
    documented = {f"{method.upper()} {path}" for path, ops in schema["paths"].items() for method in ops}
    assert {
        "POST /v1/responses",
        "POST /v1/messages",
        "POST /admin/models",
        "DELETE /admin/keys/{key_id}",
    } <= documented
    tested = {case.get("name") for case in report.iter("testcase")}
    assert documented <= tested, sorted(documented - tested)


def test_a_stateful_run_follows_every_link_create_read_delete(
    stateful: dict[str, tuple[int, int]], fuzzed: tuple[ServerProcess, str, Path]
) -> None:
    """Keys created, read and revoked; stored responses created, read,
    continued and deleted, by following the links; once deleted, a stored
    response is never served again."""
    server, secret, _ = fuzzed
    for family, (_, declared) in STATEFUL_FAMILIES.items():
        assert stateful[family] == (declared, declared), (family, stateful)
    history: dict[str, list[tuple[str, int]]] = {}
    for entry in request_lines(server):
        path = entry["path"]
        if path.startswith(("/v1/responses/", "/admin/keys/")):
            history.setdefault(path, []).append((entry["method"], entry["status"]))
    admin_id = secret.split("-")[2]
    for prefix in ("/v1/responses/resp_", "/admin/keys/"):
        lived = [
            steps
            for path, steps in history.items()
            if path.startswith(prefix)
            and not path.endswith(admin_id)
            and ("GET", 200) in steps
            and ("DELETE", 200) in steps
        ]
        assert lived, f"nothing under {prefix} was both read and deleted: {sorted(history)[:20]}"
    for path, steps in history.items():
        if path.startswith("/v1/responses/") and ("DELETE", 200) in steps:
            after = steps[steps.index(("DELETE", 200)) + 1 :]
            assert all(status == 404 for _, status in after), (path, steps)


def test_fuzz_reached_the_endpoints_and_the_server_survived(
    report: ET.Element, fuzzed: tuple[ServerProcess, str, Path]
) -> None:
    server, secret, _ = fuzzed
    assert httpx.get(f"{server.url}/ready").status_code == 200
    # Every request the fuzzer made has a log line: most schema-valid bodies must
    # have been served, not only refused by validation.
    status: dict[str, Counter[int]] = {}
    for entry in request_lines(server):
        status.setdefault(entry["path"], Counter())[entry["status"]] += 1
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize"):
        assert status.get(path, Counter())[200] > 0, status
    assert "Traceback" not in server.log()
    # The admin key still works (the fuzzer never revoked or broke it).
    keys = httpx.get(f"{server.url}/admin/keys", headers=auth(secret))
    assert keys.status_code == 200

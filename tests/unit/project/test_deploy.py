"""deploy/ checked, not just written (docs/deploy.md): the Kubernetes manifests
against the API schemas, the systemd unit with systemd's own checker, the
numbers that must agree across files (drain vs stop timeouts, probes vs load
time, threads vs CPU limit, labels vs selectors), every flag and STOKER_*
variable against `stoker serve` and `vllm-router`, and every metric that the
alerts, the autoscalers and the dashboard name against a running replica's
/metrics."""

from __future__ import annotations

import argparse
import configparser
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml
from conftest import REPO, ServerProcess
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from stoker.cli import build_parser
from stoker.config import EngineConfig
from stoker.control.settings import ControlSettings
from stoker.observe.metrics import Metrics
from stoker.server.config import EXTENSION_SKIP, ServerConfig, build

pytestmark = pytest.mark.timeout(120)

DEPLOY = Path(REPO) / "deploy"
K8S = DEPLOY / "k8s"
UNIT = DEPLOY / "systemd" / "stoker.service"
ENV_EXAMPLE = DEPLOY / "systemd" / "stoker.env.example"
ALERTS = DEPLOY / "prometheus" / "alerts.yaml"
DASHBOARD = DEPLOY / "grafana" / "stoker.json"

# The oldest Kubernetes the manifests are for (the preStop `sleep` action is on by
# default from 1.30) and the newest whose schemas the pinned kubernetes-validate ships.
K8S_VERSIONS = ("1.30", "1.37")
# What stoker does after --shutdown-timeout before it exits: aborts what is left
# with a 5 s grace (stoker/server/app.py), stops the engine, writes the last usage
# rows. A stop timeout must leave at least this much beyond the drain.
AFTER_DRAIN_S = 10
# Custom resources: not in kubernetes-validate's schemas, checked structurally below.
CRDS = {
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
}
# Labels Prometheus (with a ServiceMonitor) adds to every scraped series.
TARGET_LABELS = {"job", "instance", "namespace", "pod", "service", "container", "endpoint"}
# Series Prometheus makes itself for each target, which no replica exports.
PROMETHEUS_MADE = {"up"}


# -- Kubernetes manifests -------------------------------------------------------


@dataclass
class Manifest:
    path: Path
    doc: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.doc["kind"])

    @property
    def name(self) -> str:
        return str(self.doc["metadata"]["name"])


def kustomize_resources(directory: Path, seen: set[Path] | None = None) -> Iterator[Manifest]:
    """The objects a kustomization lists, following directories, as `kubectl apply -k`
    would gather them (without its transformations): works where kubectl is absent."""
    seen = set() if seen is None else seen
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    for entry in kustomization.get("resources", []):
        target = (directory / entry).resolve()
        assert target.exists(), f"{directory}/kustomization.yaml lists {entry}, which does not exist"
        if target.is_dir():
            yield from kustomize_resources(target, seen)
            continue
        if target in seen:
            continue
        seen.add(target)
        for doc in yaml.safe_load_all(target.read_text()):
            if doc is not None:
                yield Manifest(target, doc)


@pytest.fixture(scope="module")
def manifests() -> list[Manifest]:
    """Both variants' objects (deploy/k8s with KEDA, deploy/k8s/hpa), each file once."""
    unique: dict[tuple[Path, str, str], Manifest] = {}
    for m in [*kustomize_resources(K8S), *kustomize_resources(K8S / "hpa")]:
        unique[(m.path, m.kind, m.name)] = m
    return list(unique.values())


def one(manifests: list[Manifest], kind: str, name: str) -> dict[str, Any]:
    matches = [m.doc for m in manifests if m.kind == kind and m.name == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def test_every_manifest_file_is_applied_by_a_kustomization(manifests: list[Manifest]) -> None:
    listed = {m.path for m in manifests}
    on_disk = {
        p.resolve()
        for p in K8S.rglob("*.yaml")
        if p.name != "kustomization.yaml" and p.name != "prometheus-adapter-values.yaml"  # Helm values, not an object
    }
    assert on_disk - listed == set(), "manifests no kustomization applies"


def test_builtin_kinds_validate_against_the_kubernetes_schemas(manifests: list[Manifest]) -> None:
    checked = 0
    for m in manifests:
        if (m.doc["apiVersion"], m.kind) in CRDS:
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(m.doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(
                    f"{m.path.relative_to(REPO)}: {m.kind}/{m.name} invalid for Kubernetes {version}: {exc.message}"
                )
        checked += 1
    assert checked >= 12, checked  # the loop saw the objects (two Deployments, Services, PDBs, RBAC, HPA, ...)


def test_the_validator_rejects_what_kubernetes_would() -> None:
    """strict=True must refuse an unknown field: otherwise the test above proves nothing."""
    deployment = yaml.safe_load((K8S / "base" / "deployment.yaml").read_text())
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)


def test_custom_resources_have_their_required_fields(manifests: list[Manifest]) -> None:
    """KEDA's and the Prometheus Operator's CRDs are not in kubernetes-validate's
    schemas (and their CRD schemas are not vendored here): the fields each
    controller needs are checked by hand instead."""
    kinds = {(m.doc["apiVersion"], m.kind) for m in manifests}
    assert kinds >= CRDS
    scaled = one(manifests, "ScaledObject", "stoker")
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["name"] == "stoker"
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    assert spec["triggers"], "a ScaledObject needs a trigger"
    for trigger in spec["triggers"]:
        assert trigger["type"] == "prometheus"
        assert set(trigger["metadata"]) >= {"serverAddress", "query", "threshold"}
        assert isinstance(trigger["metadata"]["threshold"], str), "KEDA reads metadata values as strings"
        float(trigger["metadata"]["threshold"])
    rule = one(manifests, "PrometheusRule", "stoker")
    assert rule["spec"]["groups"]
    monitor = one(manifests, "ServiceMonitor", "stoker")
    assert monitor["spec"]["selector"]["matchLabels"] and monitor["spec"]["endpoints"]
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["path"] == "/metrics" and endpoint["port"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed: the kustomize build is not run")
def test_kustomize_builds_both_variants_and_they_validate() -> None:
    for directory, autoscaler, other in (
        (K8S, "ScaledObject", "HorizontalPodAutoscaler"),
        (K8S / "hpa", "HorizontalPodAutoscaler", "ScaledObject"),
    ):
        built = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
        assert built.returncode == 0, built.stderr
        docs = [d for d in yaml.safe_load_all(built.stdout) if d]
        kinds = [d["kind"] for d in docs]
        assert autoscaler in kinds and other not in kinds, (directory, kinds)
        for doc in docs:
            if doc["kind"] != "Namespace":
                assert doc["metadata"]["namespace"] == "stoker", doc["metadata"]
            if (doc["apiVersion"], doc["kind"]) not in CRDS:
                kubernetes_validate.validate(doc, K8S_VERSIONS[0], strict=True)
        images = {
            c["image"] for d in docs if d["kind"] == "Deployment" for c in d["spec"]["template"]["spec"]["containers"]
        }
        assert all("/" in image and ":" in image for image in images), images  # the images: transform applied


# -- stoker's options, as the deploy files pass them ----------------------------


def serve_parser() -> argparse.ArgumentParser:
    return build_parser("serve")


def parse_serve(args: list[str]) -> argparse.Namespace:
    """`stoker serve ARGS` as the real command line parses it (unknown flags exit 2)."""
    try:
        return serve_parser().parse_args(["serve", *args])
    except SystemExit as exc:
        raise AssertionError(f"stoker serve refuses {args}: exit {exc.code}") from None


def known_env_names() -> set[str]:
    """Every STOKER_* variable `stoker serve` reads (config.build reads STOKER_<FIELD> of each model)."""
    names = {f"STOKER_{f.upper()}" for cls in (EngineConfig, ServerConfig) for f in cls.model_fields}
    skip = EXTENSION_SKIP.get("control_config", ())
    names |= {f"STOKER_{f.upper()}" for f in ControlSettings.model_fields if f not in skip}
    # Read outside the config models: the YAML file, and the cache of converted
    # tokenizers and compiled kernels (stoker/models/cpu_kernels.py, gguf_loader.py).
    return names | {"STOKER_CONFIG", "STOKER_CACHE_DIR"}


def check_env(environ: dict[str, str], where: str) -> None:
    """Names exist and values convert, as `stoker serve` would build its configs from them."""
    stoker_vars = {k: v for k, v in environ.items() if k.startswith("STOKER_")}
    unknown = set(stoker_vars) - known_env_names()
    assert not unknown, f"{where}: stoker serve reads no {sorted(unknown)}"
    empty = argparse.Namespace()
    build(EngineConfig, {}, empty, environ=stoker_vars)
    build(ServerConfig, {}, empty, environ=stoker_vars)
    build(ControlSettings, {}, empty, environ=stoker_vars, skip=EXTENSION_SKIP.get("control_config", ()))


def option_value(args: argparse.Namespace, name: str, model: type[Any]) -> Any:
    return getattr(args, name) if hasattr(args, name) else model.model_fields[name].default


def test_env_check_catches_a_misspelled_variable() -> None:
    with pytest.raises(AssertionError, match="STOKER_REDIS_URI"):
        check_env({"STOKER_REDIS_URI": "redis://x"}, "test")
    with pytest.raises(AssertionError, match="refuses"):
        parse_serve(["--shutdown-timeout-s", "30"])


# -- the replicas' Deployment -----------------------------------------------------


def stoker_container(manifests: list[Manifest]) -> dict[str, Any]:
    containers = one(manifests, "Deployment", "stoker")["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "stoker")


def seconds(quantity: str | int) -> float:
    return float(quantity)


def cpu_cores(quantity: str | int) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def test_deployment_drains_within_its_grace_period(manifests: list[Manifest]) -> None:
    pod = one(manifests, "Deployment", "stoker")["spec"]["template"]["spec"]
    container = stoker_container(manifests)
    args = parse_serve(container["args"])
    assert hasattr(args, "shutdown_timeout"), "pass --shutdown-timeout explicitly: the grace period is computed from it"
    drain = float(args.shutdown_timeout)
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = pod["terminationGracePeriodSeconds"]
    assert grace >= pre_stop + drain + AFTER_DRAIN_S, (grace, pre_stop, drain)


def test_deployment_probes_fit_stoker(manifests: list[Manifest]) -> None:
    container = stoker_container(manifests)
    args = parse_serve(container["args"])
    port = option_value(args, "port", ServerConfig)
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["http"] == port
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"  # the process: an engine restart is not fatal
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/ready"  # /health answers while the model still loads
    startup_timeout = option_value(args, "engine_startup_timeout", ServerConfig)
    assert startup["periodSeconds"] * startup["failureThreshold"] >= startup_timeout, (
        "the startup probe must wait as long as stoker itself waits for the engine to load"
    )
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["port"] in ("http", port)


def test_deployment_resources_and_threads_agree(manifests: list[Manifest]) -> None:
    container = stoker_container(manifests)
    resources = container["resources"]
    assert resources["requests"]["cpu"] == resources["limits"]["cpu"], "Guaranteed QoS: whole cores for the engine"
    assert resources["requests"]["memory"] == resources["limits"]["memory"]
    args = parse_serve(container["args"])
    assert hasattr(args, "num_threads"), "without --num-threads torch starts a thread per node core, not per CPU limit"
    assert args.num_threads == cpu_cores(resources["limits"]["cpu"])


def test_pods_run_restricted(manifests: list[Manifest]) -> None:
    for name in ("stoker", "stoker-router"):
        pod = one(manifests, "Deployment", name)["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        for container in pod["containers"]:
            ctx = container["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False
            assert ctx["readOnlyRootFilesystem"] is True
            assert ctx["capabilities"]["drop"] == ["ALL"]
            assert "limits" in container["resources"] and "requests" in container["resources"]
    namespace = one(manifests, "Namespace", "stoker")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_deployment_env_and_secret_name_real_stoker_variables(manifests: list[Manifest]) -> None:
    container = stoker_container(manifests)
    secret = one(manifests, "Secret", "stoker-secrets")
    assert [s["secretRef"]["name"] for s in container["envFrom"]] == [secret["metadata"]["name"]]
    # A template: every value is a marked placeholder, never something that looks real.
    assert all("CHANGE-ME" in value for value in secret["stringData"].values()), secret["stringData"]
    env = {e["name"]: e.get("value", "") for e in container["env"]}
    check_env({**env, **{k: v.replace("CHANGE-ME", "pw") for k, v in secret["stringData"].items()}}, "deployment")
    assert {"STOKER_DB", "STOKER_REDIS_URL"} <= set(secret["stringData"])


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_selectors_find_the_pods(manifests: list[Manifest]) -> None:
    for name in ("stoker", "stoker-router"):
        deployment = one(manifests, "Deployment", name)
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert labels_match(deployment["spec"]["selector"]["matchLabels"], labels)
        assert labels_match(one(manifests, "Service", name)["spec"]["selector"], labels)
        assert labels_match(one(manifests, "PodDisruptionBudget", name)["spec"]["selector"]["matchLabels"], labels)
    service = one(manifests, "Service", "stoker")
    monitor = one(manifests, "ServiceMonitor", "stoker")
    assert labels_match(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    port_names = {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= port_names
    targets = [one(manifests, "ScaledObject", "stoker")["spec"]["scaleTargetRef"]]
    targets.append(one(manifests, "HorizontalPodAutoscaler", "stoker")["spec"]["scaleTargetRef"])
    for target in targets:
        assert (target["kind"], target["name"]) == ("Deployment", "stoker")


# -- the router ------------------------------------------------------------------


def router_args(manifests: list[Manifest]) -> list[str]:
    return list(one(manifests, "Deployment", "stoker-router")["spec"]["template"]["spec"]["containers"][0]["args"])


def flag_values(args: list[str]) -> dict[str, list[str]]:
    """--flag=v, --flag v1 v2 and bare --flag, as argparse would group them."""
    out: dict[str, list[str]] = {}
    current = ""
    for arg in args:
        if arg.startswith("--"):
            current, _, value = arg.partition("=")
            out[current] = [value] if value else []
        else:
            out[current].append(arg)
    return out


def test_router_discovers_the_replicas_with_the_recommended_settings(manifests: list[Manifest]) -> None:
    flags = flag_values(router_args(manifests))
    replica_labels = one(manifests, "Deployment", "stoker")["spec"]["template"]["metadata"]["labels"]
    selector = dict(item.split("=", 1) for item in flags["--selector"])
    assert labels_match(selector, replica_labels)
    replica_port = option_value(parse_serve(stoker_container(manifests)["args"]), "port", ServerConfig)
    assert flags["--service-discovery-port"] == [str(replica_port)]
    # docs/routers.md, "Recommended settings": /ready checks, no circuit breaker on a full replica.
    assert flags["--health-check-endpoint"] == ["/ready"]
    assert "--disable-circuit-breaker" in flags
    role = one(manifests, "Role", "stoker-router")
    assert {"get", "list", "watch"} <= set(role["rules"][0]["verbs"]) and role["rules"][0]["resources"] == ["pods"]
    container = one(manifests, "Deployment", "stoker-router")["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert flags["--port"] == [str(ports["http"])] and flags["--prometheus-port"] == [str(ports["metrics"])]


def test_router_flags_exist_in_the_pinned_router(manifests: list[Manifest]) -> None:
    binary = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    if not os.access(binary, os.X_OK):
        pytest.skip("vllm-router (the test extra) is not installed")
    help_text = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60).stdout
    offered = set(re.findall(r"--[a-z][a-z0-9-]+", help_text))
    assert "--service-discovery" in offered  # the help was read
    used = set(flag_values(router_args(manifests)))
    assert used - offered == set()


def dockerfile_serve_args() -> list[str]:
    """The stoker image's CMD, after `stoker` (its ENTRYPOINT)."""
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    stage = text[text.index("AS stoker") :]
    assert re.search(r'^ENTRYPOINT \["stoker"\]$', stage, re.M)
    match = re.search(r"^CMD (\[.*\])$", stage, re.M)
    assert match, "the stoker image has a CMD"
    command = json.loads(match.group(1))
    assert command[0] == "serve"
    return list(command[1:])


def test_every_deployed_server_runs_authenticated(manifests: list[Manifest]) -> None:
    """Each way deploy/ starts `stoker serve` binds every interface and so runs with
    --require-auth (keys from the database its secret or env names), never --allow-open."""
    starts = {
        "Dockerfile": dockerfile_serve_args(),
        "k8s Deployment": list(stoker_container(manifests)["args"][1:]),
        "systemd unit": read_unit()["Service"]["ExecStart"].split()[2:],
    }
    for where, args in starts.items():
        parsed = parse_serve(args)
        assert option_value(parsed, "require_auth", ControlSettings) is True, f"{where}: {args}"
        assert option_value(parsed, "allow_open", ControlSettings) is False, f"{where}: {args}"
        assert option_value(parsed, "host", ServerConfig) == "0.0.0.0", f"{where}: {args}"


def test_prometheus_scrapes_with_a_metrics_key_from_a_secret(manifests: list[Manifest]) -> None:
    """/metrics takes a key with the metrics scope: the ServiceMonitor sends one as a
    bearer token, from a Secret the manifests define (a placeholder to replace)."""
    monitor = one(manifests, "ServiceMonitor", "stoker")
    for endpoint in monitor["spec"]["endpoints"]:
        authorization = endpoint["authorization"]
        assert authorization.get("type", "Bearer") == "Bearer"
        ref = authorization["credentials"]
        secret = one(manifests, "Secret", ref["name"])
        assert "CHANGE-ME" in secret["stringData"][ref["key"]]


def test_router_image_is_the_version_stoker_is_tested_behind() -> None:
    # A regex, not tomllib: stoker still runs on Python 3.10.
    match = re.search(r'"(vllm-router==[^"]+)"', (Path(REPO) / "pyproject.toml").read_text())
    assert match, "pyproject.toml's test extra pins vllm-router"
    pinned = match.group(1)
    assert f"pip install --no-cache-dir {pinned}" in (DEPLOY / "docker" / "Dockerfile").read_text()
    kustomization = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    tags = {i["name"]: i["newTag"] for i in kustomization["images"]}
    assert tags["stoker-router"] == pinned.split("==")[1]


# -- systemd -----------------------------------------------------------------------


def read_unit(path: Path = UNIT) -> configparser.ConfigParser:
    # strict=False: systemd allows a key to repeat (each Environment= line adds one).
    unit = configparser.ConfigParser(strict=False, interpolation=None, empty_lines_in_values=False)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    unit.read_string(path.read_text())
    return unit


def systemd_seconds(text: str) -> float:
    """A systemd time span ("60", "5s", "10min", "1h 30min") in seconds."""
    units = {"": 1, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)\s*", text)
    assert parts and "".join(f"{n}{u}" for n, u in parts) == re.sub(r"\s", "", text), f"not a time span: {text!r}"
    assert all(u in units for _, u in parts), f"unknown unit in {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


def test_systemd_unit_restarts_sanely_and_outlasts_the_drain() -> None:
    unit = read_unit()
    service, section = unit["Service"], unit["Unit"]
    assert service["Restart"] == "on-failure"
    assert systemd_seconds(service["RestartSec"]) == 5
    assert int(section["StartLimitBurst"]) == 5
    # The start limit lives in [Unit] since systemd 230; in [Service] it is ignored.
    assert "StartLimitIntervalSec" not in service and "StartLimitBurst" not in service
    interval = systemd_seconds(section["StartLimitIntervalSec"])
    assert interval > int(section["StartLimitBurst"]) * systemd_seconds(service["RestartSec"]), (
        "a window shorter than the restarts it counts never trips"
    )
    exec_start = service["ExecStart"].split()
    assert exec_start[1] == "serve"
    args = parse_serve(exec_start[2:])
    assert hasattr(args, "shutdown_timeout"), "pass --shutdown-timeout explicitly: TimeoutStopSec is computed from it"
    assert systemd_seconds(service["TimeoutStopSec"]) >= args.shutdown_timeout + AFTER_DRAIN_S
    assert service["KillSignal"] == "SIGTERM" and service["KillMode"] == "mixed"
    startup = option_value(args, "engine_startup_timeout", ServerConfig)
    assert systemd_seconds(service["TimeoutStartSec"]) > startup, "stoker's own load timeout should fire first"


def test_systemd_unit_is_hardened() -> None:
    service = read_unit()["Service"]
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "CapabilityBoundingSet": "",
    }.items():
        assert service[key] == value, key
    assert service["User"] and service["User"] != "root"
    assert service["EnvironmentFile"].lstrip("-") == "/etc/stoker/stoker.env"
    # Under ProtectSystem=strict only the listed paths are writable: HOME, the
    # cache and the SQLite database of the example environment file must be in them.
    writable = [Path(p) for p in service["ReadWritePaths"].split()]
    environment = dict(re.findall(r"^Environment=(\w+)=(.*)$", UNIT.read_text(), re.M))
    sqlite = dict(re.findall(r"^(STOKER_DB)=(.*)$", ENV_EXAMPLE.read_text(), re.M))["STOKER_DB"]
    for path in (environment["HOME"], environment["STOKER_CACHE_DIR"], sqlite):
        assert any(Path(path).is_relative_to(w) for w in writable), f"{path} is not writable in the unit"
    assert {f"/var/lib/{service['StateDirectory']}", f"/var/cache/{service['CacheDirectory']}"} == {
        str(w) for w in writable
    }, "systemd creates (and chowns) only StateDirectory and CacheDirectory"


def test_systemd_environment_names_real_stoker_variables() -> None:
    text = ENV_EXAMPLE.read_text()
    active = dict(re.findall(r"^(STOKER_[A-Z_]+)=(.*)$", text, re.M))
    commented = dict(re.findall(r"^#(STOKER_[A-Z_]+)=(.*)$", text, re.M))
    assert "STOKER_DB" in active and "STOKER_REDIS_URL" in commented
    check_env(active, str(ENV_EXAMPLE))
    check_env({k: v.replace("CHANGE-ME", "pw") for k, v in commented.items() if k != "STOKER_MODEL"}, "comments")
    assert set(commented) <= known_env_names()
    unit_env = dict(re.findall(r"^Environment=(STOKER_[A-Z_]+)=(.*)$", UNIT.read_text(), re.M))
    check_env(unit_env, str(UNIT))


def verify(unit_path: Path) -> str:
    result = subprocess.run(["systemd-analyze", "verify", str(unit_path)], capture_output=True, text=True, timeout=60)
    return (result.stdout + result.stderr).strip() + ("" if result.returncode == 0 else f"\nexit {result.returncode}")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    # verify insists that ExecStart's binary exists: point it at a stand-in.
    binary = tmp_path / "stoker"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    text = UNIT.read_text().replace("/opt/stoker/venv/bin/stoker", str(binary))
    unit = tmp_path / "stoker.service"
    unit.write_text(text)
    assert verify(unit) == ""
    # It reports a bad key or value on its output with exit status 0: a bad copy must show up.
    bad = tmp_path / "bad.service"
    bad.write_text(text.replace("Restart=on-failure", "Restart=sometimes"))
    assert "sometimes" in verify(bad)
    security = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--threshold=20", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if "--offline" in security.stderr and "unrecognized" in security.stderr:
        return  # systemd < 250 has no offline security audit
    assert security.returncode == 0, security.stdout[-2000:]  # exposure at most 2.0 ("OK")


# -- PromQL: the metric names an expression reads -------------------------------

PROMQL_FUNCTIONS = {
    "abs", "absent", "absent_over_time", "acos", "acosh", "asin", "asinh", "atan", "atanh", "avg_over_time",
    "ceil", "changes", "clamp", "clamp_max", "clamp_min", "cos", "cosh", "count_over_time", "day_of_month",
    "day_of_week", "day_of_year", "days_in_month", "deg", "delta", "deriv", "exp", "floor", "histogram_avg",
    "histogram_count", "histogram_fraction", "histogram_quantile", "histogram_stddev", "histogram_stdvar",
    "histogram_sum", "holt_winters", "double_exponential_smoothing", "hour", "idelta", "increase", "irate",
    "label_join", "label_replace", "last_over_time", "ln", "log10", "log2", "mad_over_time", "max_over_time",
    "min_over_time", "minute", "month", "pi", "predict_linear", "present_over_time", "quantile_over_time", "rad",
    "rate", "resets", "round", "scalar", "sgn", "sin", "sinh", "sort", "sort_by_label", "sort_by_label_desc",
    "sort_desc", "sqrt", "stddev_over_time", "stdvar_over_time", "sum_over_time", "tan", "tanh", "time",
    "timestamp", "vector", "year",
}  # fmt: skip
AGGREGATIONS = {
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
    "quantile", "limitk", "limit_ratio",
}  # fmt: skip
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = GROUPING | {"and", "or", "unless", "offset", "bool", "atan2", "start", "end"}

TOKEN = re.compile(
    r"""(?P<ws>\s+)
      | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
      | (?P<duration>(?:\d+(?:ms|[smhdwy]))+(?![\w:]))
      | (?P<number>0x[0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
      | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
      | (?P<var>\$(?:\{\w+\}|\w+))
      | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=,@])
      | (?P<open>[({\[])
      | (?P<close>[)}\]])""",
    re.X,
)
PAIRS = {"(": ")", "{": "}", "[": "]"}


@dataclass
class Selector:
    metric: str
    labels: set[str] = field(default_factory=set)


@dataclass
class Parsed:
    selectors: list[Selector]
    grouping_labels: set[str]


def promql_tokens(expr: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    pos = 0
    while pos < len(expr):
        match = TOKEN.match(expr, pos)
        if match is None:
            raise ValueError(f"cannot read {expr[pos : pos + 20]!r} in {expr!r}")
        pos = match.end()
        kind = match.lastgroup
        assert kind is not None
        if kind != "ws":
            tokens.append((kind, match.group()))
    return tokens


def parse_promql(expr: str) -> Parsed:
    """The metric selectors (with the label names they match on) and the labels of
    by/without/on/ignoring clauses. Brackets must balance; an identifier followed
    by "(" must be a PromQL function or aggregation (a typo fails here)."""
    tokens = promql_tokens(expr)
    stack: list[tuple[str, str]] = []  # (bracket, context)
    selectors: list[Selector] = []
    grouping: set[str] = set()
    previous = ""
    for i, (kind, text) in enumerate(tokens):
        following = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        context = stack[-1][1] if stack else "expr"
        if kind == "open":
            if text == "(" and previous in GROUPING:
                stack.append((text, "grouping"))
            elif text == "{":
                if not (selectors and tokens[i - 1][1] == selectors[-1].metric):
                    selectors.append(Selector(""))  # {__name__=~...} or a bare matcher list
                stack.append((text, "matchers"))
            else:
                stack.append((text, "range" if text == "[" else "expr"))
        elif kind == "close":
            assert stack and PAIRS[stack[-1][0]] == text, f"unbalanced {text!r} in {expr!r}"
            stack.pop()
        elif kind == "ident":
            if context == "matchers":
                if following in ("=", "!=", "=~", "!~"):
                    selectors[-1].labels.add(text)
            elif context == "grouping":
                grouping.add(text)
            elif text in KEYWORDS or text.lower() in ("inf", "nan"):
                pass
            elif following == "(" or (text in AGGREGATIONS and following in ("by", "without")):
                assert text in PROMQL_FUNCTIONS | AGGREGATIONS, f"unknown PromQL function {text!r} in {expr!r}"
            else:
                selectors.append(Selector(text))
        previous = text
    assert not stack, f"unclosed {stack[-1][0]!r} in {expr!r}"
    return Parsed(selectors, grouping)


def test_promql_reader_on_known_expressions() -> None:
    parsed = parse_promql(
        'histogram_quantile(0.99, sum by (le, model_name) (rate(vllm:time_to_first_token_seconds_bucket{namespace="a", '
        'model_name=~"$model"}[$__rate_interval] offset 1d))) > 2 and on (pod) up == 0'
    )
    assert [(s.metric, s.labels) for s in parsed.selectors] == [
        ("vllm:time_to_first_token_seconds_bucket", {"namespace", "model_name"}),
        ("up", set()),
    ]
    assert parsed.grouping_labels == {"le", "model_name", "pod"}
    assert [s.metric for s in parse_promql("sum(rate(a_total[5m])) by (x) / count without (y) (b)").selectors] == [
        "a_total",
        "b",
    ]
    assert [s.metric for s in parse_promql('sum by (reason) (c{reason="sum(x)"}) * 1e3 + Inf').selectors] == ["c"]
    with pytest.raises(AssertionError, match="unbalanced"):
        parse_promql("sum(rate(x[5m)))")
    with pytest.raises(AssertionError, match="unclosed"):
        parse_promql("sum(rate(x[5m])")
    with pytest.raises(AssertionError, match="unknown PromQL function"):
        parse_promql("histogram_quantil(0.9, x)")


# -- what the rules, autoscalers and dashboard read -------------------------------


def alert_groups() -> list[dict[str, Any]]:
    return list(yaml.safe_load(ALERTS.read_text())["groups"])


def recorded_series() -> dict[str, set[str]]:
    """Recording rule name -> the labels its series keep (its by (...) clauses)."""
    return {
        rule["record"]: parse_promql(rule["expr"]).grouping_labels - {"le"}
        for group in alert_groups()
        for rule in group["rules"]
        if "record" in rule
    }


def expressions() -> list[tuple[str, str]]:
    """(where, PromQL) for every query in deploy/: rules, KEDA, prometheus-adapter, dashboard."""
    found = [
        (f"alerts.yaml {rule.get('alert') or rule.get('record')}", str(rule["expr"]))
        for group in alert_groups()
        for rule in group["rules"]
    ]
    keda = yaml.safe_load((K8S / "keda-scaledobject.yaml").read_text())
    found += [("keda-scaledobject.yaml", t["metadata"]["query"]) for t in keda["spec"]["triggers"]]
    adapter = yaml.safe_load((K8S / "hpa" / "prometheus-adapter-values.yaml").read_text())
    found += [("prometheus-adapter-values.yaml", r["seriesQuery"]) for r in adapter["rules"]["custom"]]
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        found += [(f"stoker.json panel {panel['title']!r}", t["expr"]) for t in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            match = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", query)  # Grafana's, not PromQL
            assert match, query
            found.append((f"stoker.json variable {variable['name']}", match.group(1)))
    return found


@dataclass
class Exported:
    """What a replica's /metrics offers: sample names, with the labels each can carry."""

    labels: dict[str, set[str]]


def declared_labels() -> dict[str, set[str]]:
    """Label names of each family as stoker.observe.metrics declares them. A labelled
    family shows no sample until its first event (a 503, a restart), so the scrape
    alone cannot say which labels it will carry; the names come from the scrape."""
    out: dict[str, set[str]] = {}
    for attribute in vars(Metrics("m", per_key_labels=True)).values():
        if isinstance(attribute, MetricWrapperBase):
            out[attribute._name] = set(attribute._labelnames)
    return out


def exported_from(body: str) -> Exported:
    declared = declared_labels()
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(body):
        # Counters are declared without _total and scraped with it; histograms get
        # _bucket (with le), _sum and _count; _created is prometheus_client's own.
        names = {
            "counter": [family.name + "_total", family.name + "_created"],
            "histogram": [family.name + s for s in ("_bucket", "_sum", "_count", "_created")],
            "gauge": [family.name],
        }.get(family.type, [family.name])
        base = declared.get(family.name, declared.get(family.name.removesuffix("_total"), set()))
        for name in names:
            labels.setdefault(name, set()).update(base | ({"le"} if name.endswith("_bucket") else set()))
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return Exported(labels)


@pytest.fixture(scope="module")
def replica_metrics(fake_server: ServerProcess) -> Exported:
    """A running `stoker serve` (the suite's shared server over the fake engine core:
    the real server, control plane and /metrics; only the model is a stand-in, and
    which metrics exist does not depend on it)."""
    response = httpx.get(f"{fake_server.url}/metrics", timeout=10)
    assert response.status_code == 200
    return exported_from(response.text)


def test_the_scrape_reader_sees_what_a_replica_exports(replica_metrics: Exported) -> None:
    labels = replica_metrics.labels
    assert "model_name" in labels["vllm:num_requests_waiting"]
    assert labels["vllm:time_to_first_token_seconds_bucket"] >= {"le", "model_name"}
    assert labels["stoker:admission_rejections_total"] == {"reason"}
    assert "vllm:time_to_first_token_seconds" not in labels  # a histogram is read through its series
    assert "stoker:admission_rejections" not in labels  # a counter only as _total


def test_every_metric_deploy_names_exists_on_a_replica(replica_metrics: Exported) -> None:
    recorded = recorded_series()
    exported = replica_metrics.labels
    problems: list[str] = []
    checked = 0
    for where, expr in expressions():
        try:
            parsed = parse_promql(expr)
        except (AssertionError, ValueError) as exc:
            problems.append(f"{where}: {exc}")
            continue
        known_labels = set(TARGET_LABELS)
        for selector in parsed.selectors:
            assert selector.metric, f"{where}: a selector without a metric name: {expr}"
            checked += 1
            if selector.metric in PROMETHEUS_MADE:
                labels = set(TARGET_LABELS)
            elif selector.metric in recorded:
                labels = recorded[selector.metric]
            elif selector.metric in exported:
                labels = exported[selector.metric] | TARGET_LABELS
            else:
                problems.append(f"{where}: {selector.metric} is not on a replica's /metrics nor recorded")
                continue
            known_labels |= labels
            for label in selector.labels - labels:
                problems.append(f"{where}: {selector.metric} has no label {label!r}")
        for label in parsed.grouping_labels - known_labels:
            problems.append(f"{where}: groups by {label!r}, which none of its series has")
    assert not problems, "\n".join(problems)
    assert checked >= 40, checked  # the dashboard, rules and autoscalers were all read


def test_the_metric_check_refuses_a_misspelled_name(replica_metrics: Exported) -> None:
    assert "vllm:num_requests_waiting" in replica_metrics.labels
    assert "vllm:num_request_waiting" not in replica_metrics.labels
    assert "vllm:inter_token_latency_seconds_bucket" in replica_metrics.labels
    assert "vllm:time_per_output_token_seconds_bucket" not in replica_metrics.labels  # vLLM's older TPOT name


# -- alert rules ---------------------------------------------------------------------


def test_alerts_have_what_on_call_needs() -> None:
    alerts = [rule for group in alert_groups() for rule in group["rules"] if "alert" in rule]
    names = [rule["alert"] for rule in alerts]
    assert len(names) == len(set(names))
    for rule in alerts:
        assert re.fullmatch(r"\d+[smh]", str(rule.get("for", ""))), f"{rule['alert']}: needs for:"
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        for text in rule["annotations"].values():
            assert text.count("{{") == text.count("}}"), f"{rule['alert']}: unbalanced template"
        parse_promql(rule["expr"])  # brackets balance, functions exist
    # What the issue asks to be alerted on, each read from the metric that shows it.
    reads = {rule["alert"]: {s.metric for s in parse_promql(rule["expr"]).selectors} for rule in alerts}
    reads = {k: v | {m for r in v if r in recorded_series() for m in recorded_sources(r)} for k, v in reads.items()}
    wanted = {
        "vllm:time_to_first_token_seconds_bucket": "TTFT p99",
        "vllm:inter_token_latency_seconds_bucket": "TPOT p99",
        "vllm:num_requests_waiting": "queue depth",
        "stoker:request_errors_total": "error rate",
        "stoker:engine_restarts_total": "engine restarts",
        "stoker:budget_exhausted_keys": "budget exhaustion",
        "stoker:store_failures_total": "store failures",
    }
    for metric, what in wanted.items():
        assert any(metric in r for r in reads.values()), f"no alert on {what} ({metric})"
    regression = next(rule["expr"] for rule in alerts if rule["alert"] == "StokerTPOTRegression")
    assert "avg_over_time" in regression and "offset" in regression, "TPOT is compared with its own past"


def recorded_sources(record: str) -> set[str]:
    rule = next(r for g in alert_groups() for r in g["rules"] if r.get("record") == record)
    return {s.metric for s in parse_promql(rule["expr"]).selectors}


def load_generator() -> Any:
    spec = importlib.util.spec_from_file_location("to_prometheusrule", DEPLOY / "prometheus" / "to_prometheusrule.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prometheusrule_is_generated_from_the_rule_file() -> None:
    committed = (K8S / "base" / "prometheusrule.yaml").read_text()
    rendered = load_generator().render()
    assert yaml.safe_load(committed) == yaml.safe_load(rendered), (
        "deploy/k8s/base/prometheusrule.yaml is stale: python deploy/prometheus/to_prometheusrule.py > it"
    )
    assert yaml.safe_load(committed)["spec"]["groups"] == alert_groups()


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool is not installed: the PromQL reader above checks the rules"
)
def test_promtool_checks_the_rules() -> None:
    result = subprocess.run(["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# -- autoscaling ------------------------------------------------------------------------


def test_both_autoscalers_scale_on_waiting_requests_alike(manifests: list[Manifest]) -> None:
    keda = one(manifests, "ScaledObject", "stoker")["spec"]
    hpa = one(manifests, "HorizontalPodAutoscaler", "stoker")["spec"]
    query = keda["triggers"][0]["metadata"]["query"]
    assert [s.metric for s in parse_promql(query).selectors] == ["vllm:num_requests_waiting"]
    assert query.startswith("sum("), "KEDA divides the query by the threshold: it must be the total, not a mean"
    adapter = yaml.safe_load((K8S / "hpa" / "prometheus-adapter-values.yaml").read_text())["rules"]["custom"]
    served = {r["name"]["as"]: parse_promql(r["seriesQuery"]).selectors[0].metric for r in adapter}
    (metric,) = [m["pods"]["metric"]["name"] for m in hpa["metrics"]]
    assert served[metric] == "vllm:num_requests_waiting"
    assert hpa["metrics"][0]["pods"]["target"]["averageValue"] == keda["triggers"][0]["metadata"]["threshold"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (keda["minReplicaCount"], keda["maxReplicaCount"])
    assert hpa["behavior"] == keda["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    # Scale long before admission refuses: the per-replica target is far below the queue bound.
    args = parse_serve(stoker_container(manifests)["args"])
    bound = option_value(args, "max_queued_requests", ControlSettings)
    assert float(keda["triggers"][0]["metadata"]["threshold"]) * 8 <= bound


# -- dashboard ------------------------------------------------------------------------------


def test_dashboard_is_importable_grafana_json() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "model"} <= variables
    graphs = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(graphs) >= 16
    for panel in graphs:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for target in panel["targets"]:
            used = set(re.findall(r"\$\{?(\w+)", target["expr"])) - {"__rate_interval"}
            assert used <= variables, (panel["title"], used)

"""Print deploy/prometheus/alerts.yaml as a Prometheus Operator PrometheusRule.

    python deploy/prometheus/to_prometheusrule.py > deploy/k8s/base/prometheusrule.yaml

The rule file is the one source of the rules; this keeps the Kubernetes copy from
drifting (tests/unit/project/test_deploy.py compares the committed copy with this output).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

ALERTS = Path(__file__).with_name("alerts.yaml")
HEADER = """\
# GENERATED from deploy/prometheus/alerts.yaml by deploy/prometheus/to_prometheusrule.py:
# edit that file and run the script, not this one. The Prometheus Operator loads it
# when the rule selector of your Prometheus matches its labels (kube-prometheus-stack
# selects release: <its release name> by default: set the label below to yours).
"""


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the longer expressions) as literal blocks, as written in alerts.yaml."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def prometheus_rule(groups: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "stoker",
            "labels": {"app.kubernetes.io/name": "stoker", "release": "kube-prometheus-stack"},
        },
        "spec": {"groups": groups},
    }


def render(alerts_path: Path = ALERTS) -> str:
    groups = yaml.safe_load(alerts_path.read_text())["groups"]
    body = yaml.dump(prometheus_rule(groups), Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True)
    return HEADER + body


if __name__ == "__main__":
    sys.stdout.write(render())

"""The chart lints, renders every value set, and every object it renders validates
strictly against the Kubernetes schemas (kubernetes-validate) or, for the ServiceMonitor,
against a CRD schema kept here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.helm.chart import CHART_DIR, VALUE_SETS, by_kind, objects, rendered

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (dev extra) is not installed")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

# The oldest Kubernetes the chart supports (Chart.yaml's kubeVersion: the preStop sleep
# action is on by default from 1.30) and a recent one.
KUBE_VERSIONS = ("1.30.0", "1.35.0")
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): Path(__file__).parent
    / "crds"
    / "servicemonitor.schema.json"
}


def test_chart_yaml_declares_the_supported_kubernetes() -> None:
    import yaml

    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == ">=1.30.0-0"
    assert chart["apiVersion"] == "v2"


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_helm_lint_has_no_errors(name: str) -> None:
    report = helm.lint(str(CHART_DIR), VALUE_SETS[name], strict=False, namespace="serving")
    errors = [m for m in report["messages"] if m["severity"] >= 3]
    assert report["errors"] == [] and errors == [], report
    warnings = [m for m in report["messages"] if m["severity"] == 2]
    assert warnings == [], warnings


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_object_validates_strictly(name: str) -> None:
    validated = 0
    for obj in objects(name):
        key = (obj["apiVersion"], obj["kind"])
        if key in CRD_SCHEMAS:
            schema = json.loads(CRD_SCHEMAS[key].read_text())
            jsonschema.Draft202012Validator(schema).validate(obj)
            validated += 1
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                where = ".".join(str(p) for p in e.path)
                pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} ({version}): {where}: {e}")
        validated += 1
    assert validated >= 12


def test_value_sets_render_what_they_ask_for() -> None:
    default = objects("default")
    kinds = sorted({o["kind"] for o in default})
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "Secret",
        "Service",
        "ServiceAccount",
        "StatefulSet",
    ]
    assert sorted(by_kind(default, "Deployment")) == ["decode", "prefill", "router"]
    assert sorted(by_kind(default, "PodDisruptionBudget")) == ["decode", "prefill", "router"]
    assert by_kind(default, "HorizontalPodAutoscaler") == {}

    scaled = objects("autoscaling")
    hpas = by_kind(scaled, "HorizontalPodAutoscaler")
    assert sorted(hpas) == ["decode", "prefill", "router"]
    assert hpas["decode"]["spec"]["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "tandem_running_requests"},
                "target": {"type": "AverageValue", "averageValue": "24"},
            },
        }
    ]
    assert [m["resource"]["name"] for m in hpas["prefill"]["spec"]["metrics"]] == ["cpu", "memory"]
    assert hpas["prefill"]["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 600
    for component, deployment in by_kind(scaled, "Deployment").items():
        assert "replicas" not in deployment["spec"], component  # the HPA owns it
        target = hpas[component]["spec"]["scaleTargetRef"]
        assert target == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": deployment["metadata"]["name"],
        }
    assert [o["kind"] for o in scaled].count("ServiceMonitor") == 1

    external = objects("external-redis-tls")
    assert "redis" not in by_kind(external, "StatefulSet")
    assert [o for o in external if o["kind"] == "Secret"] == []  # both are existingSecrets

    colocated = objects("colocated")
    assert sorted(by_kind(colocated, "Deployment")) == ["router", "worker"]
    assert sorted(by_kind(colocated, "PodDisruptionBudget")) == ["router", "worker"]


def test_notes_render_the_commands_to_reach_the_router() -> None:
    notes = rendered("default")["tandem/templates/NOTES.txt"]
    assert "kubectl -n serving port-forward service/demo-tandem-router 50050 8000" in notes
    assert "get secret demo-tandem-auth -o jsonpath='{.data.token}'" in notes
    assert "tandem generate --router 127.0.0.1:50050" in notes
    assert "wait deployment -l app.kubernetes.io/instance=demo --for=condition=Available" in notes
    assert "Ledger: bundled Redis (demo-tandem-redis)" in notes
    open_notes = render_notes({"auth": {"enabled": False}})
    assert "WARNING: auth.enabled is false" in open_notes and "TANDEM_TOKEN" not in open_notes


def render_notes(values: dict[str, Any]) -> str:
    from tests.helm.chart import render_raw

    return render_raw(values)["tandem/templates/NOTES.txt"]

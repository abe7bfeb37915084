"""The chart under test, rendered by Helm's own engine (helm-python-sdk wraps Helm's Go
SDK), and the value sets the tests render it with."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "helm" / "tandem"
RELEASE = "demo"
NAMESPACE = "serving"

# The defaults and the value sets in helm/tandem/ci/ (the CPU-only, GPU with the
# EAGLE-3 drafter, external Redis with TLS and autoscaling, and the co-located mode),
# which are also examples for users.
VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    **{
        path.name.removesuffix("-values.yaml"): yaml.safe_load(path.read_text())
        for path in sorted((CHART_DIR / "ci").glob("*-values.yaml"))
    },
}


@functools.cache
def _chart() -> Any:
    import helm_python as helm

    return helm.Chart.load(CHART_DIR)


def render_raw(values: dict[str, Any]) -> dict[str, str]:
    """Template path -> rendered text (Helm validates ``values`` against the schema)."""
    return dict(_chart().render(values=values, name=RELEASE, namespace=NAMESPACE))


@functools.cache
def _render_set(name: str) -> str:
    return json.dumps(render_raw(VALUE_SETS[name]))


def rendered(name: str) -> dict[str, str]:
    """The templates of value set ``name``, rendered once per session."""
    return dict(json.loads(_render_set(name)))


def objects(name: str) -> list[dict[str, Any]]:
    """Every Kubernetes object value set ``name`` renders (NOTES.txt excluded)."""
    found: list[dict[str, Any]] = []
    for path, text in sorted(rendered(name).items()):
        if path.endswith("NOTES.txt"):
            continue
        found.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return found


def by_kind(objs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    """Objects of ``kind`` by their component label."""
    return {
        o["metadata"]["labels"]["app.kubernetes.io/component"]: o for o in objs if o["kind"] == kind
    }


def pod_containers(workload: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from workload["spec"]["template"]["spec"]["containers"]


_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
FIELD_VALUES = {"status.podIP": "10.1.2.3", "metadata.name": "demo-tandem-pod-0"}


def expand_args(
    container: dict[str, Any],
    config_maps: dict[str, dict[str, str]],
    field_values: dict[str, str] = FIELD_VALUES,
) -> list[str]:
    """The container's args as the kubelet runs them: $(VAR) replaced by the container's
    environment (literal values, the downward API's ``field_values``, ConfigMap keys,
    which must exist).
    Raises KeyError for a variable the container does not define."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
            continue
        source = item["valueFrom"]
        if "fieldRef" in source:
            env[item["name"]] = field_values[source["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[item["name"]] = config_maps[ref["name"]][ref["key"]]
    return [_VAR.sub(lambda m: env[m.group(1)], arg) for arg in container.get("args", [])]

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

GPU_SCHEDULING = {
    "runtimeClassName": "nvidia",
    "priorityClassName": "inference-critical",
    "topologySpreadConstraints": [
        {
            "maxSkew": 1,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "tandem"}},
        }
    ],
    "nodeSelector": {"nvidia.com/gpu.present": "true"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "podAffinityTerm": {
                        "topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "tandem"}},
                    },
                }
            ]
        }
    },
}


def _gpu_worker(num_draft_tokens: int) -> dict[str, Any]:
    return {
        **GPU_SCHEDULING,
        "resources": {
            "requests": {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": 1},
            "limits": {"memory": "64Gi", "nvidia.com/gpu": 1},
        },
        "engine": {"kvCacheMemory": 40 << 30, "maxNumSeqs": 128},
        "draft": {"enabled": True, "path": "drafts/eagle3", "numDraftTokens": num_draft_tokens},
        "shmSize": "8Gi",
    }


# The value sets the issue names (CPU-only, GPU with the EAGLE-3 drafter, external Redis
# with TLS, autoscaling on), the defaults, and the co-located mode.
VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "cpu": {
        "image": {"flavor": "cpu", "repository": "registry.example.com/tandem", "tag": "0.1.0-cpu"},
        "engine": {"dtype": "float32", "maxModelLen": 2048},
        "router": {"replicas": 1, "threads": 2},
        "prefill": {
            "replicas": 2,
            "engine": {"threads": 4, "kvCacheMemory": 1 << 30},
            "resources": {"requests": {"cpu": "4", "memory": "6Gi"}, "limits": {"cpu": "4"}},
        },
        "decode": {
            "replicas": 2,
            "engine": {"threads": 4, "kvCacheMemory": 2 << 30, "torchCompile": True},
            "resources": {"requests": {"cpu": "4", "memory": "8Gi"}, "limits": {"cpu": "4"}},
        },
    },
    "gpu-eagle3": {
        "image": {"flavor": "cuda"},
        "model": {
            "servedName": "llama-3.1-8b-instruct",
            "source": "pvc",
            "pvc": {"claimName": "models"},
            "path": "llama-3.1-8b-instruct",
        },
        "prefill": _gpu_worker(num_draft_tokens=4),
        "decode": _gpu_worker(num_draft_tokens=4),
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    },
    "external-redis-tls": {
        "redis": {
            "enabled": False,
            "namespace": "tandem-prod",
            "external": {
                "url": "rediss://redis.data.svc.cluster.local:6380/0",
                "username": "tandem",
                "existingSecret": "tandem-redis",
                "tls": {
                    "existingSecret": "tandem-redis-tls",
                    "clientCertificate": True,
                    "certReqs": "required",
                },
            },
        },
        "auth": {"existingSecret": "tandem-credentials"},
        "networkPolicy": {
            "routerFrom": [{"namespaceSelector": {"matchLabels": {"tandem/client": "true"}}}],
            "workerFrom": [{"podSelector": {"matchLabels": {"tandem/audit": "true"}}}],
        },
    },
    "autoscaling": {
        "router": {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6}},
        "prefill": {
            "autoscaling": {
                "enabled": True,
                "targetMemoryUtilizationPercentage": 85,
                "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600}},
            }
        },
        "decode": {
            "autoscaling": {
                "enabled": True,
                "maxReplicas": 10,
                "targetCPUUtilizationPercentage": None,
                "metrics": [
                    {
                        "type": "Pods",
                        "pods": {
                            "metric": {"name": "tandem_running_requests"},
                            "target": {"type": "AverageValue", "averageValue": "24"},
                        },
                    }
                ],
            }
        },
        "serviceMonitor": {"enabled": True},
    },
    "colocated": {
        "colocated": {"enabled": True, "replicas": 2},
        "model": {"source": "hostPath", "hostPath": {"path": "/var/lib/tandem/models"}},
        "prefill": {"draft": {"enabled": True, "path": "drafts/eagle3"}},
        "decode": {"draft": {"enabled": True, "path": "drafts/eagle3"}},
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

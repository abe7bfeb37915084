"""What the rendered objects say: ports agree between Services, probes and containers;
each role has its own labels and selectors; secrets appear in Secrets only; probes, the
drain, /dev/shm, the co-located mode, security and the NetworkPolicy."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from tests.helm.chart import VALUE_SETS, by_kind, objects, pod_containers

pytest.importorskip("helm_python", reason="helm-python-sdk (dev extra) is not installed")

HEALTH_SERVICES = {
    "router": "tandem.v1.Generation",
    "prefill": "tandem.v1.PrefillWorker",
    "decode": "tandem.v1.DecodeWorker",
}


def workloads(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_ports_agree_between_services_probes_and_containers(name: str) -> None:
    objs = objects(name)
    pods = {o["metadata"]["labels"]["app.kubernetes.io/component"]: o for o in workloads(objs)}
    num_checked = 0
    for service in (o for o in objs if o["kind"] == "Service"):
        selector = service["spec"]["selector"]
        (pod,) = [
            w
            for w in pods.values()
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        ports = {(p["name"], p["containerPort"]) for c in pod_containers(pod) for p in c["ports"]}
        numbers = {number for _, number in ports}
        for port in service["spec"]["ports"]:
            target = port["targetPort"]
            if isinstance(target, str):  # a named port: the container's of that name
                assert (target, port["port"]) in ports, (service["metadata"]["name"], port)
            else:
                assert target == port["port"] and target in numbers, service["metadata"]["name"]
            num_checked += 1
    assert num_checked >= 7  # router 2 + metrics 1, workers 2 each (+ redis)
    for pod in pods.values():
        for c in pod_containers(pod):
            numbers = {p["containerPort"] for p in c["ports"]}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                spec = c[probe]
                port = spec["grpc"]["port"] if "grpc" in spec else spec["tcpSocket"]["port"]
                assert port in numbers or port in {p["name"] for p in c["ports"]}, (
                    c["name"],
                    probe,
                )


@pytest.mark.parametrize("name", ["default", "colocated"])
def test_each_role_has_its_own_labels_and_selectors(name: str) -> None:
    objs = objects(name)
    selectors = {}
    for w in workloads(objs):
        component = w["metadata"]["labels"]["app.kubernetes.io/component"]
        selector = w["spec"]["selector"]["matchLabels"]
        assert selector["app.kubernetes.io/component"] == component
        assert selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        selectors[component] = selector
    assert len({tuple(sorted(s.items())) for s in selectors.values()}) == len(selectors)
    for w in workloads(objs):  # no selector matches another role's pods
        labels = w["spec"]["template"]["metadata"]["labels"]
        matching = [c for c, s in selectors.items() if s.items() <= labels.items()]
        assert matching == [labels["app.kubernetes.io/component"]]
    for kind in ("PodDisruptionBudget", "NetworkPolicy"):
        for component, o in by_kind(objs, kind).items():
            selector = o["spec"]["selector" if kind == "PodDisruptionBudget" else "podSelector"]
            assert selector["matchLabels"] == selectors[component]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_secrets_appear_in_secrets_only(name: str) -> None:
    objs = objects(name)
    secrets = [o for o in objs if o["kind"] == "Secret"]
    values = [base64.b64decode(v).decode() for s in secrets for v in s["data"].values()]
    assert all(len(v) >= 32 for v in values)
    others = repr([o for o in objs if o["kind"] != "Secret"])
    for value in values:
        assert value not in others
    for w in workloads(objs):  # credentials reach processes as files, never in env or args
        for c in pod_containers(w):
            for item in c.get("env", []):
                assert "secretKeyRef" not in item.get("valueFrom", {}), item
            assert not any("password=" in a or "token=" in a for a in c.get("args", []))


def test_generated_secrets_cover_what_the_pods_mount() -> None:
    objs = objects("default")
    secrets = {s["metadata"]["name"]: s["data"] for s in objs if s["kind"] == "Secret"}
    assert sorted(secrets) == ["demo-tandem-auth", "demo-tandem-redis"]
    assert sorted(secrets["demo-tandem-auth"]) == ["cluster-secret", "token"]
    for w in workloads(objs):
        for volume in w["spec"]["template"]["spec"]["volumes"]:
            if "secret" in volume:
                secret = volume["secret"]
                for item in secret["items"]:
                    assert item["key"] in secrets[secret["secretName"]]
    router = by_kind(objs, "Deployment")["router"]["spec"]["template"]["spec"]
    (auth,) = [v for v in router["volumes"] if v["name"] == "auth"]
    assert [i["path"] for i in auth["secret"]["items"]] == ["token", "cluster-secret"]
    prefill = by_kind(objs, "Deployment")["prefill"]["spec"]["template"]["spec"]
    (auth,) = [v for v in prefill["volumes"] if v["name"] == "auth"]
    assert [i["path"] for i in auth["secret"]["items"]] == ["cluster-secret"]  # no token


def test_probes_drain_and_shm() -> None:
    objs = objects("gpu-eagle3")
    for component, d in by_kind(objs, "Deployment").items():
        spec = d["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        assert c["startupProbe"]["grpc"]["service"] == HEALTH_SERVICES[component]
        assert c["livenessProbe"]["grpc"]["service"] == HEALTH_SERVICES[component]
        assert c["readinessProbe"]["grpc"]["service"] == ""  # NOT_SERVING once draining
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
        assert c["readinessProbe"]["failureThreshold"] == 1
        assert c["lifecycle"]["preStop"] == {"sleep": {"seconds": 5}}
        (shm,) = [v for v in spec["volumes"] if v["name"] == "shm"]
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        if component != "router":
            assert shm["emptyDir"]["sizeLimit"] == "8Gi"
            assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
            assert spec["runtimeClassName"] == "nvidia"
            assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
            assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
            assert "podAntiAffinity" in spec["affinity"]
            assert spec["priorityClassName"] == "inference-critical"
            assert spec["topologySpreadConstraints"][0]["maxSkew"] == 1


def test_colocated_pods_share_pid_namespace_user_and_shm() -> None:
    objs = objects("colocated")
    spec = by_kind(objs, "Deployment")["worker"]["spec"]["template"]["spec"]
    assert spec["shareProcessNamespace"] is True
    assert [c["name"] for c in spec["containers"]] == ["prefill", "decode"]
    uid = spec["securityContext"]["runAsUser"]
    for c in spec["containers"]:
        assert c["securityContext"].get("runAsUser", uid) == uid
        assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert len({p["containerPort"] for c in spec["containers"] for p in c["ports"]}) == 4
    services = by_kind(objs, "Service")
    for role in ("prefill", "decode"):  # headless, selecting the co-located pods
        assert services[role]["spec"]["clusterIP"] == "None"
        assert services[role]["spec"]["selector"]["app.kubernetes.io/component"] == "worker"


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_pods_run_restricted(name: str) -> None:
    for w in workloads(objects(name)):
        spec = w["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert "resources" in c


def test_model_volume_is_written_by_preparation_only() -> None:
    d = by_kind(objects("default"), "Deployment")["decode"]["spec"]["template"]["spec"]
    (prepare, _seed) = d["initContainers"]
    assert prepare["args"][:3] == ["models", "prepare", "smollm2"]
    assert {"name": "model", "mountPath": "/models"} in prepare["volumeMounts"]
    (c,) = d["containers"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    gpu = by_kind(objects("gpu-eagle3"), "Deployment")["decode"]["spec"]["template"]["spec"]
    assert "initContainers" not in gpu  # a PVC, and the CUDA image has no CPU kernels to seed
    (model,) = [v for v in gpu["volumes"] if v["name"] == "model"]
    assert model["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}


def test_network_policy_limits_worker_ports_to_cluster_components() -> None:
    objs = objects("external-redis-tls")
    policies = by_kind(objs, "NetworkPolicy")
    assert sorted(policies) == ["decode", "prefill", "router"]

    def callers(component: str) -> list[Any]:
        (grpc_rule, _metrics) = policies[component]["spec"]["ingress"]
        return grpc_rule["from"]

    def component_of(peer: dict[str, Any]) -> str:
        labels = peer["podSelector"]["matchLabels"]
        return labels.get("app.kubernetes.io/component", str(labels))

    assert [component_of(p) for p in callers("prefill")] == ["router", "{'tandem/audit': 'true'}"]
    assert [component_of(p) for p in callers("decode")][:2] == ["router", "prefill"]
    (grpc_rule, _) = policies["router"]["spec"]["ingress"]
    assert grpc_rule["from"] == [{"namespaceSelector": {"matchLabels": {"tandem/client": "true"}}}]
    assert sorted(p["port"] for p in grpc_rule["ports"]) == [8000, 50050]
    redis_policy = by_kind(objects("default"), "NetworkPolicy")["redis"]
    (rule,) = redis_policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": 6379, "protocol": "TCP"}]

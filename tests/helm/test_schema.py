"""values.schema.json refuses wrong types and unknown keys in the main sections, with a
message that names the key; the templates refuse what the schema cannot express."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helm.chart import CHART_DIR, render_raw

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (dev extra) is not installed")

# (values, what Helm's message must say)
REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"router": {"replicas": "two"}}, "at '/router/replicas': got string, want integer"),
    ({"prefill": {"replica": 2}}, "at '/prefill': additional properties 'replica' not allowed"),
    ({"decode": {"ports": {"grpc": 70000}}}, "at '/decode/ports/grpc': maximum"),
    ({"image": {"flavor": "rocm"}}, "at '/image/flavor'"),
    ({"engine": {"dtype": "int8"}}, "at '/engine/dtype'"),
    ({"model": {"source": "s3"}}, "at '/model/source'"),
    ({"model": {"hostPath": {"path": "models"}}}, "at '/model/hostPath/path'"),
    ({"redis": {"external": {"url": "redis://tandem:hunter2@redis:6379"}}}, "/redis/external/url"),
    ({"redis": {"external": {"password": "hunter2"}}}, "additional properties 'password'"),
    ({"auth": {"token": "hunter2"}}, "at '/auth': additional properties 'token' not allowed"),
    ({"redis": {"external": {"tls": {"certReqs": "maybe"}}}}, "/redis/external/tls/certReqs"),
    ({"decode": {"drain": {"graceSeconds": 0}}}, "at '/decode/drain/graceSeconds': minimum"),
    ({"router": {"extraArgs": ["-v"]}}, "at '/router/extraArgs/0'"),
    ({"router": {"resources": {"limits": {"memory": "lots"}}}}, "/router/resources/limits/memory"),
    ({"colocated": {"enabled": "yes"}}, "at '/colocated/enabled': got string, want boolean"),
    ({"networkPolicy": {"routerFrom": {}}}, "at '/networkPolicy/routerFrom': got object"),
    ({"serviceMonitor": {"interval": "often"}}, "at '/serviceMonitor/interval'"),
    ({"prefill": {"draft": {"numDraftTokens": 0}}}, "/prefill/draft/numDraftTokens"),
    ({"decode": {"engine": {"tensorParallelSize": 0}}}, "/decode/engine/tensorParallelSize"),
    ({"decode": {"engine": {"dataParallelSize": 0}}}, "/decode/engine/dataParallelSize"),
    ({"typo": True}, "additional properties 'typo' not allowed"),
]


@pytest.mark.parametrize(("values", "message"), REFUSED, ids=[m for _, m in REFUSED])
def test_bad_values_are_refused_with_a_clear_message(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmValuesError) as e:
        render_raw(values)
    assert message in str(e.value)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"model": {"source": "pvc"}}, "model.pvc.claimName is required with model.source=pvc"),
        ({"redis": {"enabled": False}}, "redis.external.url is required"),
        ({"model": {"path": "other"}}, "model.path: with model.source=prepare"),
        (
            {"prefill": {"draft": {"enabled": True, "path": "d"}}},
            "prefill.draft and decode.draft must name the same draft",
        ),
        (
            {"prefill": {"draft": {"enabled": True}}, "decode": {"draft": {"enabled": True}}},
            "decode.draft.path is required",
        ),
        (
            {
                "image": {"flavor": "cuda"},
                "decode": {
                    "engine": {"tensorParallelSize": 2},
                    "resources": {"limits": {"nvidia.com/gpu": 1}},
                },
            },
            "decode.resources.limits.nvidia.com/gpu: 1, but decode.engine.tensorParallelSize "
            "x dataParallelSize is 2 (one GPU per rank)",
        ),
        (
            {
                "image": {"flavor": "cuda"},
                "prefill": {"resources": {"requests": {"nvidia.com/gpu": 0}}},
            },
            "prefill.resources.requests.nvidia.com/gpu: 0, but prefill.engine.tensorParallelSize "
            "x dataParallelSize is 1",
        ),
        (
            {
                "image": {"flavor": "cuda"},
                "decode": {
                    "engine": {"tensorParallelSize": 2},
                    "resources": {"limits": {"nvidia.com/mig-1g.10gb": 1}},
                },
            },
            "decode.engine.tensorParallelSize x dataParallelSize: 2 ranks need whole GPUs "
            "(nvidia.com/gpu), but decode.resources name nvidia.com/mig-1g.10gb",
        ),
    ],
)
def test_templates_refuse_inconsistent_values(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError) as e:
        render_raw(values)
    assert message in str(e.value)


def test_defaults_and_schema_agree() -> None:
    with helm.Chart.load(str(CHART_DIR)) as chart:
        chart.validate_schema({})  # the defaults pass
        schema = chart.schema
    assert schema is not None and schema["additionalProperties"] is False
    for section in ("image", "model", "auth", "redis", "router", "prefill", "decode"):
        assert schema["properties"][section]["additionalProperties"] is False, section


def test_tensor_parallelism_inside_data_parallel_ranks_renders_both_sizes() -> None:
    """Data-parallel 2 x tensor-parallel 2: both flags, and on the cuda image four GPUs
    (one per rank); three are refused, naming the product."""
    both = {"dataParallelSize": 2, "tensorParallelSize": 2}
    text = render_raw({"decode": {"engine": both}})
    decode = "\n".join(v for k, v in text.items() if "decode" in k)
    assert "--data-parallel-size=$(" in decode and "--tensor-parallel-size=$(" in decode
    cuda = {"image": {"flavor": "cuda"}, "decode": {"engine": both}}
    assert "nvidia.com/gpu: 4" in "\n".join(render_raw(cuda).values())
    cuda["decode"]["resources"] = {"limits": {"nvidia.com/gpu": 3}}
    with pytest.raises(helm.HelmRenderError) as e:
        render_raw(cuda)
    assert "tensorParallelSize x dataParallelSize is 4 (one GPU per rank)" in str(e.value)

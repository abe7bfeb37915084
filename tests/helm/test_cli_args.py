"""The commands in the chart's templates are ones the `tandem` CLI accepts: every
container's args, with $(VAR) expanded as the kubelet does, parsed by the CLI's own
argument parsers (`tandem_client.cli.build_parser`, with the server's plugins)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
from typing import Any

import pytest
import yaml

from tests.helm.chart import FIELD_VALUES, VALUE_SETS, expand_args, objects, render_raw

pytest.importorskip("helm_python", reason="helm-python-sdk (dev extra) is not installed")

WORKLOADS = ("Deployment", "StatefulSet")


@functools.cache
def cli_parser() -> argparse.ArgumentParser:
    """The `tandem` command's parser, with the server's commands (its plugins)."""
    from tandem_client.cli import build_parser

    return build_parser()


def parse(argv: list[str]) -> argparse.Namespace:
    """``tandem ARGV`` as the CLI parses it; fails the test with argparse's message."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return cli_parser().parse_args(argv)
        except SystemExit:
            pass
    pytest.fail(f"tandem {' '.join(argv)}: {err.getvalue().strip()}")


def config_maps(objs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {o["metadata"]["name"]: o["data"] for o in objs if o["kind"] == "ConfigMap"}


def tandem_containers(objs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(workload name, container) for every container and init container running `tandem`."""
    found = []
    for o in objs:
        if o["kind"] not in WORKLOADS:
            continue
        spec = o["spec"]["template"]["spec"]
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            if c.get("command") == ["tandem"]:
                found.append((o["metadata"]["name"], c))
    return found


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_tandem_command_parses(name: str) -> None:
    from decode_worker import cli as decode_cli
    from engine import cli as engine_cli
    from prefill_worker import cli as prefill_cli
    from router import cli as router_cli

    objs = objects(name)
    runs = {
        "router": router_cli.run,
        "prefill": prefill_cli.run,
        "decode": decode_cli.run,
        "models": engine_cli._models_prepare,
    }
    seen = set()
    for workload, container in tandem_containers(objs):
        args = parse(expand_args(container, config_maps(objs)))
        assert args.func is runs[args.command], (workload, container["name"])
        seen.add(args.command)
        if args.command == "models":
            assert args.cache_dir == "/models"
            continue
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert args.host == "0.0.0.0" and args.port == ports["grpc"]
        assert args.advertise_host == FIELD_VALUES["status.podIP"]  # each pod its own address
        assert args.metrics_host == "0.0.0.0" and args.metrics_port == ports["metrics"]
        assert args.model.startswith("/models/")
        if args.command == "router":
            assert args.http_port == ports["http"]
    is_prepared = VALUE_SETS[name].get("model", {}).get("source", "prepare") == "prepare"
    expected = {"router", "prefill", "decode"} | ({"models"} if is_prepared else set())
    assert seen == expected


def test_engine_settings_reach_the_workers_through_the_config_map() -> None:
    objs = objects("cpu")
    workers = {
        c["name"]: c for _, c in tandem_containers(objs) if c["name"] in ("prefill", "decode")
    }
    prefill = parse(expand_args(workers["prefill"], config_maps(objs)))
    decode = parse(expand_args(workers["decode"], config_maps(objs)))
    for args in (prefill, decode):
        assert (args.dtype, args.max_model_len, args.block_size, args.threads) == (
            "float32",
            2048,
            16,
            4,
        )
        assert args.served_model_name == "smollm2" and args.model == "/models/smollm2"
        assert args.kv_transport == "auto" and args.draft is None
    assert (prefill.kv_cache_memory, decode.kv_cache_memory) == (1 << 30, 2 << 30)
    assert (prefill.eager, decode.eager) == (False, False)  # decode steps compile by default
    assert prefill.max_queued == 256 and decode.reserve_timeout_s == 60.0
    assert prefill.engine_stall_s == decode.engine_stall_s == 300.0


def test_eagle3_draft_settings_under_prefill_and_decode() -> None:
    objs = objects("gpu-eagle3")
    maps = config_maps(objs)
    (engine,) = maps.values()
    assert engine["prefill.draft"] == engine["decode.draft"] == "/models/drafts/eagle3"
    assert engine["decode.num-draft-tokens"] == "4"
    for _, container in tandem_containers(objs):
        args = parse(expand_args(container, maps))
        assert args.model == "/models/llama-3.1-8b-instruct"
        assert args.served_model_name == "llama-3.1-8b-instruct"
        assert args.draft == "/models/drafts/eagle3"  # the router names it in ListModels
        if args.command != "router":
            assert args.num_draft_tokens == 4 and args.kv_cache_memory == 40 << 30


def test_adaptive_speculation_by_default_and_a_fixed_k_when_asked() -> None:
    """Decode workers with a draft choose K per step unless ``decode.draft.adaptive`` is
    false, which reaches the decode container alone as --no-adaptive-speculation."""
    adaptive = {}
    for name, values in (
        ("default", VALUE_SETS["gpu-eagle3"]),
        (
            "fixed",
            {
                **VALUE_SETS["gpu-eagle3"],
                "decode": {
                    **VALUE_SETS["gpu-eagle3"]["decode"],
                    "draft": {**VALUE_SETS["gpu-eagle3"]["decode"]["draft"], "adaptive": False},
                },
            },
        ),
    ):
        texts = [t for p, t in render_raw(values).items() if not p.endswith("NOTES.txt")]
        objs = [d for t in texts for d in yaml.safe_load_all(t) if d]
        for _, container in tandem_containers(objs):
            args = parse(expand_args(container, config_maps(objs)))
            if args.command in ("prefill", "decode"):
                adaptive[name, args.command] = args.adaptive_speculation
    assert adaptive == {
        ("default", "prefill"): True,
        ("default", "decode"): True,
        ("fixed", "prefill"): True,
        ("fixed", "decode"): False,
    }


def test_eager_reaches_the_decode_worker_alone() -> None:
    """``decode.engine.eager`` (set in the co-located values) turns compiling off on the
    decode container of each co-located pod, and on nothing else."""
    objs = objects("colocated")
    maps = config_maps(objs)
    eager = {}
    for _, container in tandem_containers(objs):
        args = parse(expand_args(container, maps))
        eager[args.command] = getattr(args, "eager", None)
    assert eager == {"router": None, "prefill": False, "decode": True}


def test_credentials_and_redis_options() -> None:
    objs = objects("external-redis-tls")
    for _, container in tandem_containers(objs):
        args = parse(expand_args(container, config_maps(objs)))
        if args.command == "models":  # preparation needs no ledger
            assert "volumeMounts" in container and "/etc/tandem/auth" not in str(container)
            continue
        assert args.redis_url == "rediss://redis.data.svc.cluster.local:6380/0"
        assert args.redis_username == "tandem"
        assert args.redis_password_file == "/etc/tandem/redis/password"
        assert args.redis_ca_file == "/etc/tandem/redis-tls/ca.crt"
        assert args.redis_cert_file == "/etc/tandem/redis-tls/tls.crt"
        assert args.redis_key_file == "/etc/tandem/redis-tls/tls.key"
        assert args.redis_cert_reqs == "required" and args.namespace == "tandem-prod"
        assert args.cluster_secret_file == "/etc/tandem/auth/cluster-secret"
        if args.command == "router":
            assert args.auth_token_file == "/etc/tandem/auth/token"
        # The files the options name are mounted where the options say.
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        for path in ("/etc/tandem/auth", "/etc/tandem/redis", "/etc/tandem/redis-tls"):
            assert mounts[path]["readOnly"] is True

    default = objects("default")
    for _, container in tandem_containers(default):
        args = parse(expand_args(container, config_maps(default)))
        if args.command == "models":
            continue
        assert args.redis_url == "redis://demo-tandem-redis:6379/0"
        assert args.redis_password_file == "/etc/tandem/redis/password"
        assert args.redis_ca_file is None and args.redis_username is None


def test_drain_grace_is_covered_by_the_termination_grace_period() -> None:
    for name in VALUE_SETS:
        objs = objects(name)
        for o in objs:
            if o["kind"] != "Deployment":
                continue
            spec = o["spec"]["template"]["spec"]
            for container in spec["containers"]:
                args = parse(expand_args(container, config_maps(objs)))
                sleep = container["lifecycle"]["preStop"]["sleep"]["seconds"]
                assert spec["terminationGracePeriodSeconds"] >= sleep + args.grace_s + 10


def test_the_commands_notes_print_parse() -> None:
    import shlex

    from tests.helm.chart import rendered

    notes = rendered("default")["tandem/templates/NOTES.txt"]
    commands = [line.split() for line in notes.splitlines() if line.startswith("  tandem ")]
    assert [c[1] for c in commands] == ["health", "generate"]
    for line in notes.splitlines():
        if line.startswith("  tandem "):
            args = parse(shlex.split(line)[1:])
            assert args.router == "127.0.0.1:50050"


def test_suffix_decoding_reaches_the_decode_worker_without_a_draft() -> None:
    """``decode.draft.method: suffix`` with no draft model: the decode container drafts by
    suffix decoding, adaptive, K up to numDraftTokens; prefill runs plain."""
    values = {"decode": {"draft": {"method": "suffix", "numDraftTokens": 8}}}
    texts = [t for p, t in render_raw(values).items() if not p.endswith("NOTES.txt")]
    objs = [d for t in texts for d in yaml.safe_load_all(t) if d]
    seen = {}
    for _, container in tandem_containers(objs):
        args = parse(expand_args(container, config_maps(objs)))
        if args.command in ("prefill", "decode"):
            seen[args.command] = (args.draft, args.draft_method, args.num_draft_tokens)
            assert args.adaptive_speculation
    assert seen == {"prefill": (None, None, 5), "decode": (None, "suffix", 8)}


def test_tensor_parallel_sizes_reach_each_role_with_one_gpu_per_rank() -> None:
    """The tensor-parallel value set: decode split over 2 ranks, prefill on 1; on the
    cuda image each container asks for one GPU per rank. The GPU value set, which names
    its one GPU in resources, keeps it."""
    objs = objects("tensor-parallel")
    sizes, gpus = {}, {}
    for _, container in tandem_containers(objs):
        args = parse(expand_args(container, config_maps(objs)))
        if args.command in ("prefill", "decode"):
            sizes[args.command] = args.tensor_parallel_size
            resources = container["resources"]
            gpus[args.command] = (
                resources["requests"]["nvidia.com/gpu"],
                resources["limits"]["nvidia.com/gpu"],
            )
            assert resources["requests"]["cpu"] in ("8", "16")  # the rest is the role's
    assert sizes == {"prefill": 1, "decode": 2}
    assert gpus == {"prefill": (1, 1), "decode": (2, 2)}
    for _, container in tandem_containers(objects("gpu-eagle3")):
        if container["name"] in ("prefill", "decode"):
            assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    for _, container in tandem_containers(objects("cpu")):
        assert "nvidia.com/gpu" not in str(container.get("resources"))
    # A MIG slice at one rank stays as given: no whole GPU is added.
    mig = {"requests": {"cpu": "2"}, "limits": {"nvidia.com/mig-1g.10gb": 1}}
    values = {"image": {"flavor": "cuda"}, "decode": {"resources": mig}}
    texts = [t for p, t in render_raw(values).items() if not p.endswith("NOTES.txt")]
    objs = [d for t in texts for d in yaml.safe_load_all(t) if d]
    resources = {c["name"]: c["resources"] for _, c in tandem_containers(objs)}
    assert resources["decode"]["limits"]["nvidia.com/mig-1g.10gb"] == 1
    assert "nvidia.com/gpu" not in str(resources["decode"])
    assert resources["prefill"]["limits"]["nvidia.com/gpu"] == 1


def test_deepseek_v3_values_give_decode_eight_data_parallel_ranks_and_eight_gpus() -> None:
    """The DeepSeek-V3 value set: prefill split 8 ways by heads, decode 8 data-parallel
    ranks, both with whole experts over their ranks; one GPU a rank."""
    objs = objects("deepseek-v3")
    layouts = {}
    for _, container in tandem_containers(objs):
        args = parse(expand_args(container, config_maps(objs)))
        if args.command in ("prefill", "decode"):
            gpus = container["resources"]["limits"]["nvidia.com/gpu"]
            layouts[args.command] = (
                args.tensor_parallel_size,
                args.data_parallel_size,
                args.enable_expert_parallel,
                args.eager,
                gpus,
            )
    assert layouts == {"prefill": (8, 1, True, False, 8), "decode": (1, 8, True, False, 8)}

"""The images the chart's image values refer to. No container engine runs here, so the
Dockerfiles are parsed (dockerfile-parse) and checked: every path they copy exists in the
build context (the repository root), every package the distributions install is copied,
torch comes from the right index, the project is installed as scripts/install does it, and
what the chart assumes of the image (user, kernel cache, entry point) holds."""

from __future__ import annotations

import io
import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm.chart import CHART_DIR, REPO, by_kind, objects

dockerfile_parse = pytest.importorskip("dockerfile_parse", reason="dockerfile-parse (dev extra)")

IMAGES = REPO / "helm" / "images"


def flavors() -> list[str]:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    return list(schema["properties"]["image"]["properties"]["flavor"]["enum"])


def parse(flavor: str) -> Any:
    text = (IMAGES / f"Dockerfile.{flavor}").read_bytes()
    return dockerfile_parse.DockerfileParser(fileobj=io.BytesIO(text))  # re-read on each use


def instructions(parser: Any, name: str) -> list[str]:
    return [i["value"] for i in parser.structure if i["instruction"] == name]


def test_every_image_flavor_has_a_dockerfile_and_ignore_file() -> None:
    assert flavors() == ["cpu", "cuda"]
    assert sorted(p.name for p in IMAGES.iterdir()) == sorted(
        [f"Dockerfile.{f}" for f in flavors()] + [f"Dockerfile.{f}.dockerignore" for f in flavors()]
    )


@pytest.mark.parametrize("flavor", ["cpu", "cuda"])
def test_every_copied_path_exists_and_every_package_is_copied(flavor: str) -> None:
    parser = parse(flavor)
    copied: set[str] = set()
    for value in instructions(parser, "COPY") + instructions(parser, "ADD"):
        words = [w for w in shlex.split(value) if not w.startswith("--")]
        *sources, _dest = words
        for source in sources:
            assert (REPO / source).exists(), f"Dockerfile.{flavor}: COPY {source}: not in the repo"
            copied.add(source.rstrip("/"))
    server = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = server["tool"]["setuptools"]["packages"]["find"]["include"]
    for pattern in packages:  # "engine*" -> the folder engine/
        assert pattern.rstrip("*") in copied, f"Dockerfile.{flavor} does not copy {pattern}"
    readme = server["project"]["readme"]
    assert {"pyproject.toml", readme, "client"} <= copied


@pytest.mark.parametrize(
    ("flavor", "index"),
    [("cpu", "https://download.pytorch.org/whl/cpu"), ("cuda", "https://pypi.org/simple")],
)
def test_torch_then_the_project_as_scripts_install_does(flavor: str, index: str) -> None:
    parser = parse(flavor)
    assert parser.args["TORCH_INDEX_URL"] == index
    install = (REPO / "scripts" / "install").read_text()
    pinned = re.search(r"pip install --progress-bar off torch==([0-9.]+)", install)
    assert pinned is not None and parser.args["TORCH_VERSION"] == pinned.group(1)
    runs = instructions(parser, "RUN")
    (torch_step,) = [i for i, r in enumerate(runs) if 'torch==$TORCH_VERSION"' in r]
    assert '--index-url "$TORCH_INDEX_URL"' in runs[torch_step]
    # scripts/install: the client and the server in one pip call (the server depends on
    # the client, found on the same command line), after torch.
    (project_step,) = [i for i, r in enumerate(runs) if r == "pip install ./client ."]
    assert torch_step < project_step
    assert re.search(r"pip install .*-e \./client -e '\.\[dev\]'", install)


@pytest.mark.parametrize("flavor", ["cpu", "cuda"])
def test_image_runs_as_the_charts_user_with_tandem_as_entry_point(flavor: str) -> None:
    parser = parse(flavor)
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    (user,) = instructions(parser, "USER")
    assert int(user) == values["podSecurityContext"]["runAsUser"]
    assert f"--uid {user}" in " ".join(instructions(parser, "RUN"))
    assert instructions(parser, "ENTRYPOINT") == ['["tandem"]']
    assert parser.envs["VIRTUAL_ENV"] == "/opt/tandem/venv"
    assert parser.envs["PATH"].startswith("/opt/tandem/venv/bin:")
    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    header = (IMAGES / f"Dockerfile.{flavor}").read_text()
    # The build command in the header tags the image as the chart's default tag does.
    assert f"-t tandem:{chart['appVersion']}-{flavor} ." in header


def test_cpu_kernels_prebuilt_where_the_chart_seeds_them_from() -> None:
    parser = parse("cpu")
    built = parser.envs["TORCH_EXTENSIONS_DIR"]
    assert any("extension.available()" in r for r in instructions(parser, "RUN"))
    deployments = by_kind(objects("default"), "Deployment")
    router = deployments["router"]["spec"]["template"]["spec"]
    assert [c["name"] for c in router["initContainers"]] == ["prepare-model"]  # no kernels
    deployment = deployments["decode"]
    spec = deployment["spec"]["template"]["spec"]
    (seed,) = [c for c in spec["initContainers"] if c["name"] == "seed-kernels"]
    (worker,) = spec["containers"]
    cache = {e["name"]: e.get("value") for e in worker["env"]}["TORCH_EXTENSIONS_DIR"]
    assert seed["command"] == ["cp", "-a", f"{built}/.", f"{cache}/"]
    assert Path(cache).parent.as_posix() == "/var/cache/tandem"
    assert {"name": "cache", "mountPath": "/var/cache/tandem"} in worker["volumeMounts"]

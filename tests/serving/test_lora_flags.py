"""The LoRA options of `tandem serve` and the workers: ``--lora-modules NAME=PATH``
(repeatable), ``--max-loras``, ``--max-cpu-loras`` and ``--max-lora-rank`` reach the
engine's config, ``--allow-runtime-lora`` the router too; decode workers with adapters
compile as others do; malformed values are refused before anything
starts, naming the option; `tandem serve` hands the options to every worker."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from serving.lora_setup import lora_figure, worker_loras
from tests.serving.test_compile_flags import (
    REQUIRED,
    WORKER_CLIS,
    built_config,
    capture_cluster_specs,
    serve_parser,
)


def test_the_adapters_reach_the_engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from decode_worker import cli as decode_cli
    from serving.engine_setup import check_engine_arguments

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    argv = ["--lora-modules", f"a={tmp_path / 'a'}", "--lora-modules", f"org/b={tmp_path / 'b'}",
            "--max-loras", "2", "--max-lora-rank", "16", "--max-cpu-loras", "1"]  # fmt: skip
    parser = argparse.ArgumentParser()
    decode_cli.add_arguments(parser)
    args = parser.parse_args([*REQUIRED, *argv])
    assert check_engine_arguments(args, "decode worker") and not args.eager
    _, config = built_config(monkeypatch, tmp_path, True, argv)
    assert config.lora_modules == (("a", str(tmp_path / "a")), ("org/b", str(tmp_path / "b")))
    assert (config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (2, 16, 1)
    assert config.torch_compile and not config.enable_lora  # compiled, as without adapters
    _, config = built_config(monkeypatch, tmp_path, False, [*argv, "--allow-runtime-lora"])
    assert config.enable_lora and not config.torch_compile  # a prefill worker's
    with pytest.raises(ValueError, match="--lora-modules: 'm' is the served model's name"):
        built_config(monkeypatch, tmp_path, True, ["--lora-modules", f"m={tmp_path / 'a'}"])


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--lora-modules", "a"], "--lora-modules: 'a' is not NAME=PATH"),
        (["--lora-modules", "a="], "--lora-modules: 'a=' is not NAME=PATH"),
        (["--lora-modules", "my adapter=."], "--lora-modules: name 'my adapter': 1..128"),
        (["--lora-modules", "a=/nonexistent/x"], "--lora-modules: a=/nonexistent/x: no such"),
        (["--lora-modules", "a=.", "--lora-modules", "a=."], "'a' is given twice"),
        (["--max-loras", "0"], "--max-loras: must be at least 1, got 0"),
        (["--max-lora-rank", "0"], "--max-lora-rank: must be at least 1, got 0"),
        (["--max-cpu-loras", "0"], "--max-cpu-loras: must be at least 1, got 0"),
    ],
)
@pytest.mark.parametrize("cli", WORKER_CLIS, ids=["prefill", "decode"])
def test_bad_lora_options_are_refused_naming_them(
    cli: Any, argv: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args([*REQUIRED, *argv])) == 2  # before anything starts
    assert error in capsys.readouterr().err


def test_serve_hands_the_adapters_to_every_worker(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    specs = capture_cluster_specs(monkeypatch)
    args = serve_parser().parse_args(
        ["serve", "--model", "m", "--lora-modules", f"x={tmp_path}", "--max-loras", "3",
         "--allow-runtime-lora", "--max-cpu-loras", "2"]
    )  # fmt: skip
    assert args.func(args) == 1  # the captured start's error
    (spec,) = specs
    assert not spec.eager and "--allow-runtime-lora" in spec.router_args
    flags = spec.worker_args
    at = flags.index("--lora-modules")
    assert flags[at : at + 9] == (
        "--lora-modules", f"x={tmp_path}", "--allow-runtime-lora", "--max-loras", "3",
        "--max-lora-rank", "64", "--max-cpu-loras", "2",
    )  # fmt: skip


def test_the_heartbeat_figure_round_trips() -> None:
    digests = {"a": "00ff", "org/b": "0102"}
    assert worker_loras(lora_figure(digests)) == digests
    assert lora_figure({}) == {} and worker_loras({}) == {}
    assert worker_loras({"loras": "not json"}) == worker_loras({"loras": "[1]"}) == {}

"""`--tensor-parallel-size` on the workers and `tandem serve`: it reaches EngineConfig (a
split decode engine compiles, as one device's does); every worker kind takes it; `tandem
serve` gives each role its size (`--prefill-tp`, `--decode-tp`) and refuses sizes below 1.
`--data-parallel-size` likewise reaches EngineConfig from every worker and `tandem serve`."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from colocated_worker import cli as colocated_cli
from decode_worker import cli as decode_cli
from prefill_worker import cli as prefill_cli
from serving import engine_setup
from tests.serving.test_compile_flags import (
    REQUIRED,
    built_config,
    capture_cluster_specs,
    serve_parser,
)


def test_the_size_reaches_the_engine_config(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _, config = built_config(monkeypatch, tmp_path, True, ["--tensor-parallel-size", "2"])
    assert config.tensor_parallel_size == 2 and config.torch_compile
    _, config = built_config(
        monkeypatch, tmp_path, True, ["--tensor-parallel-size", "2", "--eager"]
    )
    assert config.tensor_parallel_size == 2 and not config.torch_compile
    _, config = built_config(monkeypatch, tmp_path, True, [])
    assert config.tensor_parallel_size == 1


@pytest.mark.parametrize(
    ("cli", "prog"),
    [
        (prefill_cli, "prefill worker"),
        (decode_cli, "decode worker"),
        (colocated_cli, "co-located worker"),
    ],
    ids=["prefill", "decode", "colocated"],
)
def test_every_worker_takes_a_split_model_but_not_below_one_rank(
    cli, prog: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args([*REQUIRED, "--tensor-parallel-size", "2"])
    assert engine_setup.check_engine_arguments(args, prog)
    assert capsys.readouterr().err == ""
    zero = parser.parse_args([*REQUIRED, "--tensor-parallel-size", "0"])
    assert not engine_setup.check_engine_arguments(zero, prog)
    assert "--tensor-parallel-size: must be at least 1, got 0" in capsys.readouterr().err
    assert cli.run(zero) == 2  # before anything starts


def role_args(spec, role: str) -> str | None:
    """The --tensor-parallel-size a role's workers get, or None."""
    args = {"prefill": spec.prefill_args, "decode": spec.decode_args}[role]
    assert "--tensor-parallel-size" not in spec.worker_args
    return args[args.index("--tensor-parallel-size") + 1] if args else None


@pytest.mark.parametrize(
    ("flags", "prefill", "decode"),
    [
        (["--tensor-parallel-size", "2"], "2", "2"),
        (["--prefill-tp", "2"], "2", None),
        (["--decode-tp", "2"], None, "2"),
        (["--tensor-parallel-size", "2", "--prefill-tp", "1", "--decode-tp", "3"], None, "3"),
        (["--colocate", "--tensor-parallel-size", "2"], None, "2"),
        (["--colocate", "--decode-tp", "2"], None, "2"),
    ],
)
def test_serve_gives_each_role_its_size(
    monkeypatch: pytest.MonkeyPatch, flags: list[str], prefill: str | None, decode: str | None
) -> None:
    specs = capture_cluster_specs(monkeypatch)
    args = serve_parser().parse_args(["serve", "--model", "m", *flags])
    assert args.func(args) == 1  # the captured cluster refuses to start
    (spec,) = specs
    assert (role_args(spec, "prefill"), role_args(spec, "decode")) == (prefill, decode)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prefill-tp", "0"], "--prefill-tp: must be at least 1, got 0"),
        (["--decode-tp", "-1"], "--decode-tp: must be at least 1, got -1"),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size: must be at least 1, got 0"),
        (["--colocate", "--prefill-tp", "2"], "--prefill-tp: not with --colocate"),
    ],
)
def test_serve_refuses_sizes_it_cannot_run(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    message: str,
) -> None:
    specs = capture_cluster_specs(monkeypatch)
    args = serve_parser().parse_args(["serve", "--model", "m", *flags])
    assert args.func(args) == 2
    assert message in capsys.readouterr().err
    assert specs == []


def test_fp8_weights_reach_the_engine_config_and_serve_passes_them_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A block-FP8 checkpoint's projections: "auto" (kept FP8 on the Triton kernels' path,
    dequantized at load time elsewhere) unless a worker is told otherwise; `tandem serve
    --fp8-weights` tells every worker."""
    _, config = built_config(monkeypatch, tmp_path, True, [])
    assert config.fp8_weights == "auto"
    _, config = built_config(monkeypatch, tmp_path, False, ["--fp8-weights", "keep"])
    assert config.fp8_weights == "keep"
    specs = capture_cluster_specs(monkeypatch)
    args = serve_parser().parse_args(["serve", "--model", "m", "--fp8-weights", "keep"])
    assert args.func(args) == 1  # the captured cluster refuses to start
    (spec,) = specs
    i = spec.worker_args.index("--fp8-weights")
    assert spec.worker_args[i + 1] == "keep"


def test_the_data_parallel_size_reaches_every_worker_and_the_engine_config(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, config = built_config(monkeypatch, tmp_path, True, ["--data-parallel-size", "2"])
    assert config.data_parallel_size == 2 and config.torch_compile
    _, config = built_config(monkeypatch, tmp_path, False, ["--data-parallel-size", "2"])
    assert config.data_parallel_size == 2
    for cli, prog in ((prefill_cli, "prefill"), (decode_cli, "decode"), (colocated_cli, "co")):
        parser = argparse.ArgumentParser()
        cli.add_arguments(parser)
        zero = parser.parse_args([*REQUIRED, "--data-parallel-size", "0"])
        assert not engine_setup.check_engine_arguments(zero, prog)
        assert "--data-parallel-size: must be at least 1, got 0" in capsys.readouterr().err
    specs = capture_cluster_specs(monkeypatch)
    args = serve_parser().parse_args(["serve", "--model", "m", "--data-parallel-size", "2"])
    assert args.func(args) == 1  # the captured cluster refuses to start
    (spec,) = specs
    i = spec.worker_args.index("--data-parallel-size")
    assert spec.worker_args[i + 1] == "2"

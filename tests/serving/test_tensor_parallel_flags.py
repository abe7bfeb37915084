"""`--tensor-parallel-size` on the workers and `tandem serve`: it reaches EngineConfig (a
split decode engine compiles, as one device's does); prefill and decode workers
refuse it (KV transfer between split workers is not built), co-located ones take it, and
`tandem serve` passes it to co-located workers only, refusing it without --colocate."""

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
    ("cli", "prog", "refused"),
    [
        (prefill_cli, "prefill worker", True),
        (decode_cli, "decode worker", True),
        (colocated_cli, "co-located worker", False),
    ],
    ids=["prefill", "decode", "colocated"],
)
def test_only_co_located_workers_take_a_split_model(
    cli, prog: str, refused: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args([*REQUIRED, "--tensor-parallel-size", "2"])
    ok = engine_setup.check_engine_arguments(args, prog, transfers_kv=refused)
    err = capsys.readouterr().err
    assert ok is not refused
    if refused:
        assert cli.run(args) == 2  # before anything starts
        assert (
            "--tensor-parallel-size 2: KV transfer between split prefill and decode workers "
            "is not built yet" in capsys.readouterr().err
        )
    else:
        assert err == ""
    zero = parser.parse_args([*REQUIRED, "--tensor-parallel-size", "0"])
    assert not engine_setup.check_engine_arguments(zero, prog)
    assert "--tensor-parallel-size: must be at least 1, got 0" in capsys.readouterr().err


def test_serve_passes_it_to_co_located_workers_and_refuses_it_otherwise(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    specs = capture_cluster_specs(monkeypatch)
    parser = serve_parser()
    args = parser.parse_args(["serve", "--model", "m", "--tensor-parallel-size", "2"])
    assert args.func(args) == 2
    assert "--tensor-parallel-size 2: needs --colocate" in capsys.readouterr().err
    assert specs == []
    argv = ["serve", "--model", "m", "--colocate", "--tensor-parallel-size", "2"]
    args = parser.parse_args(argv)
    assert args.func(args) == 1  # the captured cluster refuses to start
    (spec,) = specs
    assert spec.colocate
    i = spec.worker_args.index("--tensor-parallel-size")
    assert spec.worker_args[i + 1] == "2"

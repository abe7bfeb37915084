"""--transfer-stall-s: both worker kinds take it (default 10 s, positive), and `tandem serve`
refuses a deadline that is not positive before it starts anything."""

from __future__ import annotations

import argparse

import pytest

from decode_worker import cli as decode_cli
from prefill_worker import cli as prefill_cli
from serving.cli import register_serve

REQUIRED = ["--model", "m", "--redis-url", "redis://127.0.0.1:1/0"]


@pytest.mark.parametrize("cli", [prefill_cli, decode_cli], ids=["prefill", "decode"])
def test_workers_take_a_positive_stall_deadline(
    cli: object, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)  # type: ignore[attr-defined]
    assert parser.parse_args(REQUIRED).transfer_stall_s == 10.0
    assert parser.parse_args([*REQUIRED, "--transfer-stall-s", "2.5"]).transfer_stall_s == 2.5
    for bad in ("0", "-1", "nan"):
        with pytest.raises(SystemExit):
            parser.parse_args([*REQUIRED, "--transfer-stall-s", bad])
        assert f"--transfer-stall-s: must be positive, got {bad}" in capsys.readouterr().err


def test_serve_refuses_a_deadline_that_is_not_positive(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    register_serve(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", "m", "--transfer-stall-s", "0"])
    assert args.func(args) == 2
    assert capsys.readouterr().err == (
        "tandem serve: error: --transfer-stall-s: must be positive, got 0\n"
    )

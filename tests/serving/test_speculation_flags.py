"""Adaptive speculation is the workers' default with a draft: --num-draft-tokens bounds K,
--no-adaptive-speculation fixes it; `tandem serve` and both workers take both flags, and
refuse --no-adaptive-speculation without a draft; scripts/demo starts adaptive."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

import pytest

from decode_worker import cli as decode_cli
from prefill_worker import cli as prefill_cli
from serving import engine_setup
from serving.launcher import (
    ADAPTIVE_STARTUP_S,
    COMPILE_STARTUP_S,
    STARTUP_TIMEOUT_S,
    ClusterSpec,
)
from tests.serving.test_compile_flags import built_config, capture_cluster_specs, serve_parser

REPO = Path(__file__).resolve().parents[2]
REQUIRED = ["--model", "m", "--redis-url", "redis://127.0.0.1:1/0"]


@pytest.mark.parametrize(
    ("is_decoding", "argv", "adaptive"),
    [
        (True, [], True),
        (True, ["--no-adaptive-speculation"], False),
        (False, [], False),  # a prefill worker's first drafts are K deep either way
        (False, ["--no-adaptive-speculation"], False),
    ],
)
def test_decode_workers_choose_k_unless_told_not_to(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    is_decoding: bool,
    argv: list[str],
    adaptive: bool,
) -> None:
    argv = ["--draft", str(tmp_path), "--num-draft-tokens", "4", *argv]
    _, config = built_config(monkeypatch, tmp_path, is_decoding, argv)
    assert config.speculative.adaptive is adaptive
    assert config.speculative.num_draft_tokens == 4  # the bound, or the fixed K


@pytest.mark.parametrize("cli", [prefill_cli, decode_cli], ids=["prefill", "decode"])
def test_workers_refuse_a_fixed_k_without_a_draft(
    cli: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert parser.parse_args(REQUIRED).adaptive_speculation
    assert cli.run(parser.parse_args([*REQUIRED, "--no-adaptive-speculation"])) == 2
    assert "--no-adaptive-speculation: needs --draft" in capsys.readouterr().err


def test_serve_hands_the_choice_to_its_workers(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    specs = capture_cluster_specs(monkeypatch)
    parser = serve_parser()
    for argv, adaptive in (([], True), (["--no-adaptive-speculation"], False)):
        args = parser.parse_args(["serve", "--model", "m", "--draft", "/d", *argv])
        assert args.func(args) == 1  # the captured start's error
        assert specs[-1].adaptive_speculation is adaptive
        worker_args = specs[-1].engine_args()
        assert ("--no-adaptive-speculation" in worker_args) is not adaptive
        assert worker_args[worker_args.index("--num-draft-tokens") + 1] == "5"
    alone = parser.parse_args(["serve", "--model", "m", "--no-adaptive-speculation"])
    assert alone.func(alone) == 2 and len(specs) == 2
    assert "--no-adaptive-speculation: needs --draft" in capsys.readouterr().err


def test_decode_workers_that_measure_their_costs_get_more_time_to_start() -> None:
    adaptive = ClusterSpec(model="m", draft="/d", num_decode=2)
    fixed = ClusterSpec(model="m", draft="/d", num_decode=2, adaptive_speculation=False)
    plain = ClusterSpec(model="m", num_decode=2)
    assert plain.startup_timeout_s() == fixed.startup_timeout_s()
    assert adaptive.startup_timeout_s() == STARTUP_TIMEOUT_S + 2 * (
        COMPILE_STARTUP_S + ADAPTIVE_STARTUP_S
    )


def test_the_demo_starts_adaptive() -> None:
    text = (REPO / "scripts" / "demo").read_text().replace('"$port"', "50051")
    line = next(line for line in text.replace("\\\n", " ").splitlines() if "tandem serve" in line)
    words = shlex.split(line.strip().rstrip("&"))
    args = serve_parser().parse_args(words[words.index("serve") :])
    assert args.draft and args.adaptive_speculation


@pytest.mark.parametrize(
    ("is_decoding", "argv", "kind", "adaptive"),
    [
        (True, [], "suffix", True),
        (True, ["--no-adaptive-speculation", "--suffix-cache-tokens", "0"], "suffix", False),
        (False, [], None, None),  # a prefill worker has no drafts to make for suffix decoding
    ],
)
def test_suffix_decoding_needs_no_draft_directory(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    is_decoding: bool,
    argv: list[str],
    kind: str | None,
    adaptive: bool | None,
) -> None:
    args, config = built_config(
        monkeypatch, tmp_path, is_decoding, ["--draft-method", "suffix", *argv]
    )
    assert engine_setup.check_engine_arguments(args, "worker")
    speculative = config.speculative
    assert (speculative and speculative.kind, speculative and speculative.adaptive) == (
        kind,
        adaptive,
    )
    if speculative is not None:  # the shared index's cap, as given
        assert speculative.suffix.shared_tokens == args.suffix_cache_tokens
        assert args.suffix_cache_tokens == (0 if "--suffix-cache-tokens" in argv else 1 << 18)


def test_a_negative_suffix_cache_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    decode_cli.add_arguments(parser)
    argv = [*REQUIRED, "--draft-method", "suffix", "--suffix-cache-tokens", "-1"]
    assert decode_cli.run(parser.parse_args(argv)) == 2
    assert "--suffix-cache-tokens: must be 0 or more, got -1" in capsys.readouterr().err


def write_draft_config(directory: Path, architecture: str) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text(f'{{"architectures": ["{architecture}"]}}')
    return directory


@pytest.mark.parametrize("cli", [prefill_cli, decode_cli], ids=["prefill", "decode"])
def test_a_draft_method_that_does_not_fit_the_draft_is_refused(
    cli: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    eagle3 = str(write_draft_config(tmp_path / "eagle3", "LlamaForCausalLMEagle3"))
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    cases = [
        (["--draft", eagle3, "--draft-method", "eagle"], "--draft-method eagle: the draft"),
        (["--draft", eagle3, "--draft-method", "suffix"], "--draft-method suffix, --draft:"),
        (["--draft-method", "dflash"], "--draft-method dflash: needs --draft DIR"),
        (["--draft", eagle3, "--draft-method", "mtp"], "--draft-method mtp, --draft: the MTP"),
    ]
    for argv, error in cases:
        assert cli.run(parser.parse_args([*REQUIRED, *argv])) == 2
        assert error in capsys.readouterr().err
    matching = parser.parse_args([*REQUIRED, "--draft", eagle3, "--draft-method", "eagle3"])
    assert engine_setup.check_engine_arguments(matching, "worker")


def test_serve_hands_suffix_decoding_to_its_workers(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    specs = capture_cluster_specs(monkeypatch)
    parser = serve_parser()
    argv = ["serve", "--model", "m", "--draft-method", "suffix", "--suffix-cache-tokens", "64"]
    args = parser.parse_args(argv)
    assert args.func(args) == 1  # the captured start's error
    (spec,) = specs
    assert spec.draft is None and spec.speculates
    worker_args = spec.engine_args()
    assert worker_args[worker_args.index("--draft-method") + 1] == "suffix"
    assert worker_args[worker_args.index("--suffix-cache-tokens") + 1] == "64"
    assert "--draft" not in worker_args and "--num-draft-tokens" in worker_args
    both = parser.parse_args(["serve", "--model", "m", "--draft", "/d", "--draft-method", "suffix"])
    assert both.func(both) == 2 and len(specs) == 1
    assert "--draft-method suffix, --draft:" in capsys.readouterr().err

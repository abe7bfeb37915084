"""Compiled by default: decode workers compile their decode steps unless --eager, prefill
workers never do; `tandem serve`, both workers and the chart take --eager; --torch-compile
is still accepted and changes nothing; scripts/demo starts compiled."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from decode_worker import cli as decode_cli
from prefill_worker import cli as prefill_cli
from serving import engine_setup
from serving.cli import register_serve
from serving.launcher import COMPILE_STARTUP_S, STARTUP_TIMEOUT_S, ClusterError, ClusterSpec

REPO = Path(__file__).resolve().parents[2]
REQUIRED = ["--model", "m", "--redis-url", "redis://127.0.0.1:1/0"]
WORKER_CLIS = [prefill_cli, decode_cli]


def built_config(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, is_decoding: bool, argv: list[str]
) -> tuple[argparse.Namespace, Any]:
    """A worker's parsed ``argv`` (after REQUIRED) and the EngineConfig it builds from them
    (LLMEngine replaced by a recorder; the model is ``tmp_path``)."""
    built: list[Any] = []

    class Recorder:
        """Records the config; has what build_engine then calls (an executor's hook)."""

        def __init__(self, config: Any, tokenizer: Any) -> None:
            built.append(config)
            self.runner = SimpleNamespace(executor=SimpleNamespace(on_rank_lost=built.append))

    monkeypatch.setattr("engine.llm_engine.LLMEngine", Recorder)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    parser = argparse.ArgumentParser()
    (decode_cli if is_decoding else prefill_cli).add_arguments(parser)
    args = parser.parse_args([*REQUIRED, *argv])
    draft = Path(args.draft) if args.draft else None
    spec = engine_setup.ModelSpec(tmp_path, "m", draft, args.num_draft_tokens, args.draft_method)
    engine_setup.build_engine(spec, args, is_decoding=is_decoding)
    from serving.engine_loop import exit_worker

    config, on_rank_lost = built
    assert on_rank_lost is exit_worker  # a split engine's lost rank ends the worker
    return args, config


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem")
    register_serve(parser.add_subparsers())
    return parser


def capture_cluster_specs(monkeypatch: pytest.MonkeyPatch) -> list[ClusterSpec]:
    """The specs `tandem serve` builds, each start refused (exit 1) before anything runs."""
    specs: list[ClusterSpec] = []

    class Captured:
        def __init__(self, spec: ClusterSpec) -> None:
            specs.append(spec)

        def start(self) -> None:
            raise ClusterError("captured")

    monkeypatch.setattr("serving.launcher.Cluster", Captured)
    monkeypatch.setattr("engine.model_store.resolve_model", lambda name, **_: Path("/models/m"))
    return specs


@pytest.mark.parametrize("cli", WORKER_CLIS, ids=["prefill", "decode"])
def test_workers_take_eager_and_refuse_it_beside_torch_compile(
    cli: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert not parser.parse_args(REQUIRED).eager
    assert parser.parse_args([*REQUIRED, "--eager"]).eager
    both = parser.parse_args([*REQUIRED, "--eager", "--torch-compile"])
    assert cli.run(both) == 2  # before anything starts
    assert "--torch-compile, --eager: give one" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("is_decoding", "eager", "compiles"),
    [(True, False, True), (True, True, False), (False, False, False), (False, True, False)],
)
def test_decode_workers_compile_unless_eager_and_prefill_workers_never(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, is_decoding: bool, eager: bool, compiles: bool
) -> None:
    _, config = built_config(monkeypatch, tmp_path, is_decoding, ["--eager"] if eager else [])
    assert config.torch_compile is compiles
    assert config.warm_up and not config.build_cpu_kernels  # warm before SERVING, no C++ build


def test_the_compile_cache_is_kept_under_tandems_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from engine.model_store import use_compile_cache

    # set, then removed: monkeypatch undoes use_compile_cache's setdefault at teardown
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unset below")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    assert use_compile_cache() == tmp_path / "compile"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_compile_cache() == tmp_path / "mine"  # a user's setting stands


def test_serve_passes_eager_to_the_workers_and_notes_torch_compile(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    specs = capture_cluster_specs(monkeypatch)
    parser = serve_parser()
    for argv, eager in ((["--eager"], True), ([], False), (["--torch-compile"], False)):
        args = parser.parse_args(["serve", "--model", "m", *argv])
        assert args.func(args) == 1  # the captured start's error
        assert specs[-1].eager is eager
    assert "--torch-compile is the default now and changes nothing" in capsys.readouterr().err
    both = parser.parse_args(["serve", "--model", "m", "--eager", "--torch-compile"])
    assert both.func(both) == 2 and len(specs) == 3


def test_compiling_workers_get_more_time_to_start_and_eager_reaches_them() -> None:
    compiled, eager = ClusterSpec(model="m", num_decode=2), ClusterSpec(model="m", eager=True)
    assert compiled.startup_timeout_s() == STARTUP_TIMEOUT_S + 2 * COMPILE_STARTUP_S
    assert eager.startup_timeout_s() == STARTUP_TIMEOUT_S
    assert "--eager" not in compiled.engine_args() and "--eager" in eager.engine_args()


def test_the_demo_starts_compiled() -> None:
    """scripts/demo's `tandem serve` line parses (its shell variables given values),
    without --eager."""
    text = (REPO / "scripts" / "demo").read_text().replace('"$port"', "50051")
    line = next(line for line in text.replace("\\\n", " ").splitlines() if "tandem serve" in line)
    words = shlex.split(line.strip().rstrip("&"))
    args = serve_parser().parse_args(words[words.index("serve") :])
    assert args.model == "smollm2" and not args.eager and not args.torch_compile

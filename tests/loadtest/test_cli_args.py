"""`tandem loadtest`'s command line without a server: --help documents the metrics, and bad
arguments exit 2 naming the argument (argparse's code, as every `tandem` command)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem_client.cli import main


def test_help_defines_the_metrics(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["loadtest", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "(E2E - TTFT) / (tokens - 1)" in out  # TPOT
    assert "shared evenly" in out  # ITL under speculation
    assert "Accepted tokens per step" in out and "requests.jsonl" in out
    for option in (
        "--request-rate", "--burstiness", "--slo", "--warmup", "--prefix-len", "--output-dir",
        "--metrics-url", "--no-plots",
    ):  # fmt: skip
        assert option in out


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--request-rate", "-1"], "--request-rate"),
        (["--request-rate", "1,x"], "--request-rate"),
        (["--slo", "latency_ms=5"], "--slo"),
        (["--slo", "ttft_ms=-5"], "--slo"),
        (["--concurrency", "0"], "--concurrency"),
        (["--range-ratio", "1.5"], "--range-ratio"),
        (["--token-ids", "9:3"], "--token-ids"),
        (["--dataset", "/nonexistent/prompts.jsonl"], "--dataset"),
        (["--target", "openai"], "--base-url"),
        (["--metrics-url", "127.0.0.1:9100/metrics"], "--metrics-url"),
        (["--output-dir", __file__], "--output-dir"),  # a file, not a directory
        (["--output-dir", f"{__file__}/report"], "--output-dir"),  # cannot be created
    ],
)
def test_bad_arguments_exit_2(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["loadtest", "--router", "127.0.0.1:1", *argv])
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err


def test_malformed_dataset_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text("{not json\n")
    with pytest.raises(SystemExit) as exit_:
        main(["loadtest", "--dataset", str(path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--dataset" in err and "broken.jsonl:1" in err

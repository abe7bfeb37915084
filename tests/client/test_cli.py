from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from tandem_client import __version__, cli


def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["models", "--help"]])
def test_help_lists_commands_without_importing_torch(argv: list[str]) -> None:
    result = _run_python(
        f"""
        import sys
        from tandem_client.cli import main
        try:
            main({argv!r})
        except SystemExit as exc:
            assert exc.code == 0, exc.code
        else:
            raise AssertionError("--help did not exit")
        heavy = [m for m in ("torch", "transformers") if m in sys.modules]
        assert not heavy, f"--help imported {{heavy}}"
        """
    )
    assert result.returncode == 0, result.stderr
    if argv == ["--help"]:
        assert "models" in result.stdout and "generate" in result.stdout
        assert "Not installed" not in result.stdout
    elif argv[0] == "generate":
        for option in ("--model", "--dtype", "--max-tokens", "--chat", "--stop", "PROMPT"):
            assert option in result.stdout, option
    else:
        assert "prepare" in result.stdout and "list" in result.stdout


def test_console_script_version() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tandem_client", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"tandem {__version__}"


def test_help_without_server_commands() -> None:
    help_text = cli.build_parser(plugins=[]).format_help()
    assert "Not installed: models, serve" in help_text
    assert "tandem-server" in help_text


def test_generate_without_the_server_asks_for_a_router(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With no in-process engine installed, `tandem generate` still parses and says what to do."""
    generate_ep = EntryPoint("generate", "tandem_client.generate:register_generate", "x")
    parser = cli.build_parser(plugins=[generate_ep])
    args = parser.parse_args(["generate", "hello"])
    assert args.func(args) == 2  # in-process without --model, or no engine: refused
    from tandem_client import generate

    assert generate._generate(args, None) == 2
    assert "give --router HOST:PORT" in capsys.readouterr().err


def test_broken_plugin_is_skipped(capsys: pytest.CaptureFixture[str]) -> None:
    broken = EntryPoint("broken", "no_such_module_xyz:register", cli.ENTRY_POINT_GROUP)
    help_text = cli.build_parser(plugins=[broken]).format_help()
    assert "broken" not in help_text.split("commands:")[-1]
    assert "skipping command 'broken'" in capsys.readouterr().err


def test_main_runs_a_subcommand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["models", "list", "--cache-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.split() == ["smollm2", "(not", "prepared)"]


def test_main_without_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "usage: tandem" in capsys.readouterr().err

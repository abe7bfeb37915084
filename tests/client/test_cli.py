"""`tandem` as a program, with no cluster: every command's help, plugins and the conflict
of two claiming one name, the exit codes and their one-line messages. The commands
against a live cluster: test_cli_cluster.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import EntryPoint
from pathlib import Path

import grpc
import pytest

from tandem_client import (
    DeadlineExceeded,
    InvalidRequest,
    NotFound,
    Overloaded,
    TandemError,
    Unauthenticated,
    Unavailable,
    __version__,
    cli,
    exit_codes,
    plugins,
)
from tandem_client.exit_codes import ExitCode, error_line, exit_code
from tests.doc_pages import page


def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


CLIENT_COMMANDS = ("chat", "generate", "health", "loadtest", "models")
SERVER_COMMANDS = ("serve", "router", "prefill", "decode", "ledger", "train-draft", "draft-data")


@pytest.mark.parametrize(
    "argv",
    [["--help"], *([name, "--help"] for name in CLIENT_COMMANDS), ["models", "list", "--help"]],
)
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
    assert not result.stderr  # no plugin skipped, no conflict
    if argv[-2:] != ["list", "--help"]:
        assert "examples:" in result.stdout and "exit codes:" in result.stdout
        assert "5    timed out" in result.stdout
    if argv == ["--help"]:
        listed = result.stdout.split("commands:")[1].split("examples:")[0].split()
        for name in (*CLIENT_COMMANDS, *SERVER_COMMANDS):
            assert name in listed, name
        assert "Not installed" not in result.stdout
    elif argv[0] == "generate":
        for option in ("--model", "--dtype", "--max-tokens", "--chat", "--stop", "PROMPT"):
            assert option in result.stdout, option
        assert "--router HOST:PORT" in result.stdout and "TANDEM_ROUTER" in result.stdout
    elif argv[0] == "chat":
        assert "/reset" in result.stdout and "/exit" in result.stdout
    elif argv[0] == "health":
        assert "SERVING" in result.stdout and "--wait" in result.stdout
    elif argv == ["models", "--help"]:
        assert "prepare" in result.stdout and "list" in result.stdout
    elif argv[0] == "loadtest":
        assert "--request-rate" in result.stdout and "TPOT" in result.stdout
    else:
        assert "--router" in result.stdout and "--cache-dir" in result.stdout


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
    assert "Not installed: serve, router, prefill, decode" in help_text
    assert "tandem-server" in help_text


def client_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if tandem-client alone were installed: the entry points of other
    distributions are gone."""
    real = plugins.entry_points

    def entry_points(*, group: str) -> list[EntryPoint]:
        return [ep for ep in real(group=group) if ep.value.startswith("tandem_client.")]

    monkeypatch.setattr(plugins, "entry_points", entry_points)


def test_without_the_server_model_says_tandem_server_is_needed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`generate --model` without --router runs in-process: without tandem-server
    installed it says so (exit 2); `models` has no `prepare` and no local list."""
    client_only(monkeypatch)
    monkeypatch.delenv("TANDEM_ROUTER", raising=False)
    assert cli.main(["generate", "--model", "smollm2", "hello"]) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tandem generate: error: --model without")
    assert "needs the tandem-server distribution" in err and "--router" in err
    help_text = cli.build_parser().format_help()
    assert "Not installed: serve, router, prefill, decode" in help_text
    with pytest.raises(SystemExit) as raised:
        cli.main(["models", "prepare", "smollm2"])
    assert raised.value.code == ExitCode.USAGE
    assert "invalid choice: 'prepare'" in capsys.readouterr().err


def with_extra(monkeypatch: pytest.MonkeyPatch, group: str, extra: EntryPoint) -> None:
    """The installed entry points, plus ``extra`` in ``group``."""
    real = plugins.entry_points

    def entry_points(*, group: str) -> list[EntryPoint]:
        found = list(real(group=group))
        return [*found, extra] if group == extra.group else found

    monkeypatch.setattr(plugins, "entry_points", entry_points)


def test_two_plugins_claiming_a_command_stop_the_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The server's old `models` registration beside the client's: an error naming both,
    before any command runs, whatever the command line."""
    old = EntryPoint("models", "engine.cli:register_models", plugins.COMMANDS_GROUP)
    with_extra(monkeypatch, plugins.COMMANDS_GROUP, old)
    for argv in (["--help"], ["health"], []):
        assert cli.main(argv) == ExitCode.ERROR
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert err.startswith("tandem: error: 2 installed plugins claim the name 'models'")
        assert "models = tandem_client.models:register_models from tandem-client 0.1.0" in err
        assert "models = engine.cli:register_models" in err


def test_two_local_model_plugins_stop_the_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second `tandem.models.local` (or in-process engine) is a conflict too, though its
    name differs: each group fills one slot."""
    other = EntryPoint("other", "other_server.cli:add_local_models", plugins.LOCAL_MODELS_GROUP)
    with_extra(monkeypatch, plugins.LOCAL_MODELS_GROUP, other)
    assert cli.main(["models", "list"]) == ExitCode.ERROR
    err = capsys.readouterr().err
    assert "2 installed plugins claim the local models of `tandem models`" in err
    assert "engine = engine.cli:add_local_models from tandem-server" in err
    assert "other = other_server.cli:add_local_models" in err


def test_one_plugin_seen_twice_is_no_conflict() -> None:
    """An editable install's metadata found twice on the path is one plugin."""
    ep = EntryPoint("generate", "tandem_client.generate:register_generate", cli.ENTRY_POINT_GROUP)
    assert plugins.by_name(cli.ENTRY_POINT_GROUP, [ep, ep]) == [ep]


def test_installed_distributions_share_models_through_the_local_group() -> None:
    """Both real distributions installed: the client owns `models`; the server plugs in
    through `tandem.models.local` and no longer claims the command."""
    commands = {ep.name: ep.value for ep in plugins.by_name(plugins.COMMANDS_GROUP)}
    assert commands["models"] == "tandem_client.models:register_models"
    assert commands["serve"] == "serving.cli:register_serve"
    local = plugins.the_one(plugins.LOCAL_MODELS_GROUP, "local models")
    assert local is not None and local.value == "engine.cli:add_local_models"
    result = subprocess.run(
        [sys.executable, "-m", "tandem_client", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0 and not result.stderr, result.stderr


@pytest.mark.parametrize(
    ("error", "code", "says"),
    [
        (Unavailable(grpc.StatusCode.UNAVAILABLE, "no\nroute"), 3, "is unavailable (no route)"),
        (
            InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, "top_p: > 1"),
            4,
            "refused the request: top_p",
        ),
        (NotFound(grpc.StatusCode.NOT_FOUND, "model: x"), 4, "refused the request: model: x"),
        (DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED, "late"), 5, "no answer within 2.5 s"),
        (
            Overloaded(grpc.StatusCode.RESOURCE_EXHAUSTED, "full"),
            6,
            "overloaded (full); retry later",
        ),
        (Unauthenticated(grpc.StatusCode.UNAUTHENTICATED, "bad"), 7, "pass --token"),
        (TandemError(grpc.StatusCode.INTERNAL, "boom"), 1, "failed the request: INTERNAL: boom"),
    ],
)
def test_each_failure_is_one_line_and_its_exit_code(
    error: TandemError, code: int, says: str
) -> None:
    line = error_line("generate", error, "10.0.0.5:50050", 2.5)
    assert exit_code(error) == code
    assert "\n" not in line and line.startswith("tandem generate: error: ") and says in line
    if code == 3:
        assert "10.0.0.5:50050" in line and "--router" in line


def test_exit_codes_are_documented() -> None:
    """Every ExitCode is in the table `--help` prints, with its number, and in docs/cli.md's."""
    table = exit_codes.EXIT_CODES_HELP.splitlines()[1:]
    assert [int(line.split()[0]) for line in table] == [int(c) for c in ExitCode]
    docs = page("cli.md")
    for line in table:
        number, words = line.split(maxsplit=1)
        assert f"| {number} | {words} |" in docs, line


def test_broken_plugin_is_skipped(capsys: pytest.CaptureFixture[str]) -> None:
    broken = EntryPoint("broken", "no_such_module_xyz:register", cli.ENTRY_POINT_GROUP)
    help_text = cli.build_parser(plugins=[broken]).format_help()
    assert "broken" not in help_text.split("commands:")[-1]
    assert "skipping command 'broken'" in capsys.readouterr().err


def test_main_runs_a_subcommand(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tandem models list` without a router lists the local models (the server's plugin)."""
    monkeypatch.delenv("TANDEM_ROUTER", raising=False)
    assert cli.main(["models", "list", "--cache-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.split() == ["smollm2", "(not", "prepared)"]


def test_main_without_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "usage: tandem" in capsys.readouterr().err

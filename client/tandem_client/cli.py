"""The `tandem` command line.

Subcommands are plugins: each installed distribution may declare entry points in
the group ``tandem.commands``. An entry point is a callable ``register(subparsers)``
that adds one subcommand and sets ``func`` on its parser with ``set_defaults``;
``func(args)`` runs the command and returns an exit code (``None`` means 0).
Registration only builds parsers, so ``tandem --help`` stays fast and never
imports torch; heavy imports happen inside the handlers. Two plugins claiming one
name stop the command at start-up (tandem_client.plugins).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import EntryPoint

from tandem_client import __version__
from tandem_client.errors import TandemError
from tandem_client.exit_codes import EXIT_CODES_HELP, ExitCode, error_line, exit_code
from tandem_client.options import HelpFormatter, router_address
from tandem_client.plugins import COMMANDS_GROUP, PluginConflict, by_name

ENTRY_POINT_GROUP = COMMANDS_GROUP

# Subcommands that the server distribution (`tandem-server`) provides.
SERVER_COMMANDS = ("serve", "router", "prefill", "decode")

DESCRIPTION = """\
Tandem serves large language models: prompts are prefilled on prefill workers,
their KV cache is shipped to decode workers, and each decode step runs the target
model and a draft model together (unified speculative decoding).

This command line gathers the subcommands of every installed Tandem distribution.
Run `tandem COMMAND --help` for the options of one command."""

EXAMPLES = """\
examples:
  tandem serve --model smollm2                 # a whole cluster on this machine
  tandem health                                # SERVING? (exit 0 only then)
  tandem models                                # what the router serves
  tandem generate "Write a haiku about the sea."
  tandem chat --temperature 0.7
The router commands ask --router HOST:PORT, else $TANDEM_ROUTER, else 127.0.0.1:50050."""

Register = Callable[[argparse._SubParsersAction], None]


def discover_plugins() -> list[EntryPoint]:
    """The entry points of group `tandem.commands`, one per name, sorted by name;
    PluginConflict where two distributions claim one name."""
    return by_name(ENTRY_POINT_GROUP)


def build_parser(plugins: Sequence[EntryPoint] | None = None) -> argparse.ArgumentParser:
    """The top-level parser with one subcommand per loadable plugin; PluginConflict for
    a name (here, or in a command's own plugin group) that two plugins claim."""
    plugins = discover_plugins() if plugins is None else by_name(ENTRY_POINT_GROUP, plugins)
    parser = argparse.ArgumentParser(
        prog="tandem",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", dest="command")

    installed: list[str] = []
    for ep in plugins:
        try:
            register: Register = ep.load()
            register(subparsers)
        except PluginConflict:
            raise
        except Exception as exc:  # a broken plugin must not take the whole CLI down
            print(f"tandem: skipping command {ep.name!r} ({ep.value}): {exc}", file=sys.stderr)
            continue
        installed.append(ep.name)

    missing = [name for name in SERVER_COMMANDS if name not in installed]
    epilog = [EXAMPLES, "", EXIT_CODES_HELP]
    if not installed:
        epilog.append("\nNo commands are installed.")
    if missing:
        epilog.append(
            f"\nNot installed: {', '.join(missing)}. These and more come with the "
            "`tandem-server` distribution (pip install tandem-server)."
        )
    parser.epilog = "\n".join(epilog)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, run the chosen subcommand, and return its exit code: a
    failed call to the router is one line on stderr and its code (tandem_client.exit_codes)."""
    try:
        parser = build_parser()
    except PluginConflict as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return ExitCode.ERROR
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return ExitCode.USAGE
    try:
        rc = func(args)
    except TandemError as exc:
        timeout_s = getattr(args, "timeout", None)
        print(error_line(args.command, exc, router_address(args), timeout_s), file=sys.stderr)
        return exit_code(exc)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return ExitCode.INTERRUPTED
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())

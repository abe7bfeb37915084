"""The `tandem` command line.

Subcommands are plugins: each installed distribution may declare entry points in
the group ``tandem.commands``. An entry point is a callable ``register(subparsers)``
that adds one subcommand and sets ``func`` on its parser with ``set_defaults``;
``func(args)`` runs the command and returns an exit code (``None`` means 0).
Registration only builds parsers, so ``tandem --help`` stays fast and never
imports torch; heavy imports happen inside the handlers.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import EntryPoint, entry_points

from tandem_client import __version__

ENTRY_POINT_GROUP = "tandem.commands"

# Subcommands that the server distribution (`tandem-server`) provides.
SERVER_COMMANDS = ("models", "serve")

DESCRIPTION = """\
Tandem serves large language models: prompts are prefilled on prefill workers,
their KV cache is shipped to decode workers, and each decode step runs the target
model and a draft model together (unified speculative decoding).

This command line gathers the subcommands of every installed Tandem distribution.
Run `tandem COMMAND --help` for the options of one command."""

Register = Callable[[argparse._SubParsersAction], None]


def discover_plugins() -> list[EntryPoint]:
    """The entry points of group `tandem.commands`, one per name, sorted by name."""
    by_name: dict[str, EntryPoint] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        by_name.setdefault(ep.name, ep)
    return [by_name[name] for name in sorted(by_name)]


def build_parser(plugins: Sequence[EntryPoint] | None = None) -> argparse.ArgumentParser:
    """The top-level parser with one subcommand per loadable plugin."""
    if plugins is None:
        plugins = discover_plugins()
    parser = argparse.ArgumentParser(
        prog="tandem",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")

    installed: list[str] = []
    for ep in plugins:
        try:
            register: Register = ep.load()
            register(subparsers)
        except Exception as exc:  # a broken plugin must not take the whole CLI down
            print(f"tandem: skipping command {ep.name!r} ({ep.value}): {exc}", file=sys.stderr)
            continue
        installed.append(ep.name)

    missing = [name for name in SERVER_COMMANDS if name not in installed]
    epilog = []
    if not installed:
        epilog.append("No commands are installed.")
    if missing:
        epilog.append(
            f"Not installed: {', '.join(missing)}. These and more come with the "
            "`tandem-server` distribution (pip install tandem-server)."
        )
    parser.epilog = "\n".join(epilog) or None
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, run the chosen subcommand, and return its exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    rc = func(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())

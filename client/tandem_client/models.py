"""`tandem models`: the models a router serves, or the ones prepared on this machine.

The client owns the name `models` and the server plugs its local subcommands in through
the ``tandem.models.local`` entry point, as it plugs its engine into `tandem generate`:
two distributions registering `models` in ``tandem.commands`` would be two plugins
claiming one name, which stops `tandem` at start-up. The entry point is a callable
``add_local(subparsers, list_parser) -> list_local(args)``: it adds its own subcommands
(`prepare`) and its options of `list`, and returns the function that lists local models.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from typing import Any

from tandem_client.exit_codes import EXIT_CODES_HELP, ExitCode
from tandem_client.options import HelpFormatter, add_router_options, is_router_given, open_client
from tandem_client.plugins import LOCAL_MODELS_GROUP, the_one
from tandem_client.results import ModelInfo

Run = Callable[[argparse.Namespace], int]
Subparsers = Any  # argparse._SubParsersAction; private in argparse

EXAMPLES = f"""\
examples:
  tandem models --router 10.0.0.5:50050    # what that router serves
  tandem models list                       # local models (tandem-server), else the router's
  tandem models prepare smollm2            # convert once, cached (tandem-server)

Without --router or $TANDEM_ROUTER, `models` and `models list` list the models prepared
on this machine when tandem-server is installed, and else ask the router at
127.0.0.1:50050.

{EXIT_CODES_HELP}"""


def register_models(subparsers: Subparsers) -> None:
    """Add `tandem models` and `tandem models list`, and the server's local subcommands."""
    parser = subparsers.add_parser(
        "models",
        help="list the models a router serves, or the local ones",
        description="List the models a router serves: name, context length in tokens, "
        "draft model (and its kind), and for a LoRA adapter its parent model. Without a "
        "router, list the models prepared on this machine (with tandem-server, which also "
        "adds `prepare`).",
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    add_router_options(parser, timeout_s=10.0)
    sub = parser.add_subparsers(title="subcommands", metavar="SUBCOMMAND")
    list_parser = sub.add_parser(
        "list",
        help="list the router's models, or the local ones (the default subcommand)",
        description="As `tandem models`: the router's models with --router or "
        "$TANDEM_ROUTER, else the local ones.",
    )
    add_router_options(list_parser, timeout_s=10.0, is_sub_level=True)
    list_local = _local(sub, list_parser)
    func = partial(_list, list_local=list_local)
    parser.set_defaults(func=func)
    list_parser.set_defaults(func=func)


def _local(sub: Subparsers, list_parser: argparse.ArgumentParser) -> Run | None:
    """The local listing that a server distribution plugs in (after adding its
    subcommands and options); None without one."""
    ep = the_one(LOCAL_MODELS_GROUP, "the local models of `tandem models`")
    if ep is None:
        return None
    run: Run = ep.load()(sub, list_parser)
    return run


def _list(args: argparse.Namespace, list_local: Run | None) -> int:
    if list_local is not None and not is_router_given(args):
        return list_local(args)
    with open_client(args) as client:
        models = client.models()
    print(format_models(models), end="")
    return ExitCode.OK


def format_models(models: list[ModelInfo]) -> str:
    """A table: one line per model (the router's default first, then its LoRA adapters,
    each with its parent) under a header."""
    rows = [("NAME", "CONTEXT", "DRAFT", "PARENT")]
    for m in models:
        draft = f"{m.draft_model} ({m.draft_kind})" if m.draft_model else "-"
        rows.append((m.name, str(m.max_model_len), draft, m.parent or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}" for r in rows]
    return "".join(line + "\n" for line in lines)

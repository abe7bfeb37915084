"""`tandem health`: whether a router is SERVING, for people and for scripts (exit 0
only when it is)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from tandem_client.errors import Unavailable
from tandem_client.exit_codes import EXIT_CODES_HELP, ExitCode
from tandem_client.options import HelpFormatter, add_router_options, open_client
from tandem_client.sdk import TandemClient

Subparsers = Any  # argparse._SubParsersAction; private in argparse

POLL_S = 0.5

EXAMPLES = f"""\
examples:
  tandem health                              # the router at $TANDEM_ROUTER or 127.0.0.1:50050
  tandem health --router 10.0.0.5:50050
  tandem health --wait 300 && tandem generate "Hello"   # once a cluster is up

{EXIT_CODES_HELP}"""


def register_health(subparsers: Subparsers) -> None:
    """Add `tandem health`."""
    parser = subparsers.add_parser(
        "health",
        help="is the router SERVING? (exit 0 only then)",
        description="Ask a router's gRPC health service whether it can serve requests now "
        "and print its status: SERVING once a warm prefill and decode worker (or a warm "
        "co-located worker) is registered for its model; NOT_SERVING while its workers "
        "start (a decode worker compiles for minutes at its first start), after it lost "
        "them, or while it drains. The exit code is 0 only when SERVING; 3 when NOT_SERVING "
        "or unreachable.",
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    add_router_options(parser, timeout_s=10.0)
    parser.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="ask again until it is SERVING, for up to this long (default: ask once)",
    )
    parser.set_defaults(func=_health)


def _health(args: argparse.Namespace) -> int:
    with open_client(args) as client:
        status = wait_until_serving(client, args.wait)
    print(status)
    return ExitCode.OK if status == "SERVING" else ExitCode.UNAVAILABLE


def wait_until_serving(client: TandemClient, wait_s: float) -> str:
    """The router's health status once SERVING, or the last one after ``wait_s``
    seconds; Unavailable if it could not be reached by then."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            status = client.health()
        except Unavailable:
            if time.monotonic() >= deadline:
                raise
        else:
            if status == "SERVING" or time.monotonic() >= deadline:
                return status
        time.sleep(POLL_S)

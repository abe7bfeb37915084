"""The options the commands that talk to a router share (its address, the deadline, the
token; the sampling parameters), and the SDK client they open from them."""

from __future__ import annotations

import argparse
import os
import textwrap
from typing import Any

from tandem_client.request import SamplingKwargs
from tandem_client.sdk import TandemClient

ROUTER_ENV = "TANDEM_ROUTER"
TOKEN_ENV = "TANDEM_TOKEN"
DEFAULT_ROUTER = "127.0.0.1:50050"  # `tandem serve`'s default port
# Retries of UNAVAILABLE before a first answer: few, so that a router that is not there is
# reported within a second (`--wait` is for a cluster that is still starting).
NUM_RETRIES = 2


class HelpFormatter(argparse.HelpFormatter):
    """Refills prose to the terminal's width, and keeps indented lines (examples, the
    table of exit codes) as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        lines: list[str] = []
        prose: list[str] = []

        def fill() -> None:
            if prose:
                filled = textwrap.fill(
                    " ".join(prose), width, initial_indent=indent, subsequent_indent=indent
                )
                lines.append(filled)
                prose.clear()

        for line in text.splitlines():
            if line and not line[0].isspace():
                prose.append(line.strip())
                continue
            fill()
            lines.append(indent + line if line.strip() else "")
        fill()
        return "\n".join(lines)


def add_router_options(
    parser: argparse.ArgumentParser, *, timeout_s: float, is_sub_level: bool = False
) -> None:
    """--router, --timeout and --token. ``is_sub_level``: the same options again on a
    subcommand (`tandem models list`), whose unset ones keep the parent's values."""
    group = parser.add_argument_group("router")

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if is_sub_level else value

    group.add_argument(
        "--router",
        metavar="HOST:PORT",
        default=default(None),
        help=f"the router's address (default: ${ROUTER_ENV} if set, else {DEFAULT_ROUTER})",
    )
    group.add_argument(
        "--timeout",
        type=float,
        default=default(timeout_s),
        metavar="SECONDS",
        help=f"each call's deadline (default: {timeout_s:g})",
    )
    group.add_argument(
        "--token",
        default=default(None),
        help=f"bearer token for a router that requires one (default: ${TOKEN_ENV} if set)",
    )


def router_address(args: argparse.Namespace) -> str:
    """--router, else $TANDEM_ROUTER, else the default address."""
    return str(getattr(args, "router", None) or os.environ.get(ROUTER_ENV) or DEFAULT_ROUTER)


def is_router_given(args: argparse.Namespace) -> bool:
    """Whether the user named a router (--router or $TANDEM_ROUTER)."""
    return bool(getattr(args, "router", None) or os.environ.get(ROUTER_ENV))


def open_client(args: argparse.Namespace) -> TandemClient:
    """An SDK client of the router that ``args`` name, with their deadline and token."""
    token = args.token or os.environ.get(TOKEN_ENV) or None
    return TandemClient(
        router_address(args), timeout=args.timeout, max_retries=NUM_RETRIES, token=token
    )


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    """The sampling parameters (the names `tandem.v1.SamplingParams` and the in-process
    engine read)."""
    group = parser.add_argument_group("sampling")
    group.add_argument(
        "--max-tokens", type=int, default=256, help="tokens to generate at most (default: 256)"
    )
    group.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default: 0)")
    group.add_argument("--top-k", type=int, default=0, help="keep the k likeliest (0: off)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1: off)")
    group.add_argument("--min-p", type=float, default=0.0, help="min-p sampling (0: off)")
    group.add_argument("--seed", type=int, default=None, help="seed of a sampled answer")
    group.add_argument(
        "--stop", action="append", default=[], metavar="STR", help="stop string (repeatable)"
    )
    group.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence")


def sampling_kwargs(args: argparse.Namespace) -> SamplingKwargs:
    """The SDK's sampling keywords from the options ``add_sampling_options`` added."""
    kwargs = SamplingKwargs(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    if args.seed is not None:
        kwargs["seed"] = args.seed
    return kwargs

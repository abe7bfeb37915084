"""`tandem generate`: through a running cluster's router, or in this process.

Through a router (the default) the prompts go to a cluster with the SDK (no torch
needed). With ``--model`` and no ``--router``, the prompts run on an engine in this
process, which the server distribution provides through the
``tandem.generate.in_process`` entry point: a callable ``add_arguments(parser) -> run(args)``
that adds its engine options and returns the function that generates.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from tandem_client.errors import InvalidRequest, Unavailable
from tandem_client.exit_codes import EXIT_CODES_HELP, ExitCode
from tandem_client.health import wait_until_serving
from tandem_client.options import (
    HelpFormatter,
    add_router_options,
    add_sampling_options,
    open_client,
    sampling_kwargs,
)
from tandem_client.plugins import IN_PROCESS_GENERATE_GROUP, the_one
from tandem_client.request import Prompt
from tandem_client.sdk import TandemClient
from tandem_client.terminal import Streamed, print_stream

# The router's refusal of a chat prompt for a model without a template
# (router/validation.py): the default --chat then falls back to plain text.
NO_CHAT_TEMPLATE = "has no chat template"

WAIT_POLL_S = 1.0  # with --wait: the pause before asking again a router that has no worker yet

Run = Callable[[argparse.Namespace], int]
Subparsers = Any  # argparse._SubParsersAction; private in argparse

EXAMPLES = f"""\
examples:
  tandem generate "What is the capital of France?"       # the router at $TANDEM_ROUTER or :50050
  tandem generate --router 10.0.0.5:50050 --max-tokens 64 --temperature 0.8 --seed 1 "Hi"
  tandem generate --no-chat --stop . "Once upon a time"   # plain text, no chat template
  tandem generate --router 127.0.0.1:50050 --wait 300 "Hi"   # a cluster still starting
  tandem generate --model smollm2 --dtype float32 "Hi"   # in-process (tandem-server)

The answer streams to stdout (after a ">>> PROMPT" line when there are several
prompts); a line of figures follows each on stderr.

{EXIT_CODES_HELP}"""


def register_generate(subparsers: Subparsers) -> None:
    """Add `tandem generate`."""
    parser = subparsers.add_parser(
        "generate",
        help="generate text through a running cluster's router, or in-process",
        description="Send one or more prompts to a running cluster (`tandem serve`) and "
        "print each answer as it streams, then its tokens, time to first token and tokens "
        "per second on stderr. With --model and no --router, run the engine in this process "
        "instead (needs the tandem-server distribution).",
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text")
    add_router_options(parser, timeout_s=600.0)
    parser.add_argument(
        "--model",
        help="with a router: the served model or one of its LoRA adapters to ask (default: "
        "the router's first; `tandem models --router ADDR` lists them); "
        "without --router: run this model in-process, a prepared name (smollm2) or a HF "
        "model directory",
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait up to this long for a cluster that is still starting: for the router to "
        "be SERVING and to have workers",
    )
    parser.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap each prompt in the model's chat template (default: when it has one)",
    )
    add_sampling_options(parser)
    in_process = _in_process(parser)
    parser.set_defaults(func=partial(_generate, in_process=in_process))


def _in_process(parser: argparse.ArgumentParser) -> Run | None:
    """The in-process engine's run function, its options added to ``parser``; None
    where no installed distribution provides one."""
    ep = the_one(IN_PROCESS_GENERATE_GROUP, "the in-process engine of `tandem generate`")
    if ep is None:
        return None
    group = parser.add_argument_group("in-process engine (--model without --router)")
    run: Run = ep.load()(group)
    return run


def _generate(args: argparse.Namespace, in_process: Run | None) -> int:
    if args.model and not args.router:
        if in_process is None:
            print(
                "tandem generate: error: --model without --router runs the model in this "
                "process, which needs the tandem-server distribution (pip install "
                "tandem-server); or pass --router HOST:PORT to ask a running cluster",
                file=sys.stderr,
            )
            return ExitCode.USAGE
        return in_process(args)
    return generate_through_router(args)


def generate_through_router(args: argparse.Namespace) -> int:
    """Each prompt's answer printed as it streams, then its figures on stderr."""
    deadline = time.monotonic() + args.wait
    with open_client(args) as client:
        if args.wait:
            wait_until_serving(client, args.wait)
        is_chat: bool | None = args.chat
        for text in args.prompts:
            if len(args.prompts) > 1:
                print(f">>> {text}", flush=True)
            streamed, is_chat = _stream_one(client, text, args, is_chat, deadline)
            print(streamed.stats_line(), file=sys.stderr, flush=True)
    return ExitCode.OK


def _stream_one(
    client: TandemClient,
    text: str,
    args: argparse.Namespace,
    is_chat: bool | None,
    deadline: float,
) -> tuple[Streamed, bool | None]:
    """The answer to ``text``, and whether prompts are chats from now on: unset
    (``None``) means a chat unless the router says the model has no template. Until
    ``deadline`` (monotonic; --wait), UNAVAILABLE before the first chunk (a router whose
    workers are still starting) is asked again."""
    while True:
        prompt: Prompt = text if is_chat is False else [{"role": "user", "content": text}]
        started = time.perf_counter()
        chunks = client.stream(prompt, model=args.model or "", **sampling_kwargs(args))
        try:
            first = [next(chunks)]  # a refusal comes here, before anything is printed
        except StopIteration:
            first = []
        except InvalidRequest as e:
            if is_chat is None and NO_CHAT_TEMPLATE in e.message:
                is_chat = False
                continue
            raise
        except Unavailable:
            if time.monotonic() >= deadline:
                raise
            time.sleep(WAIT_POLL_S)
            continue
        return print_stream(chunks, started, first), is_chat

"""`tandem chat`: a conversation with a served model in the terminal. Each turn sends
the whole conversation as chat messages (the router applies the model's template) and
streams the answer; /reset starts over, /exit or end of input quits, Ctrl-C stops an
answer and returns to the prompt."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Any

from tandem_client.errors import TandemError
from tandem_client.exit_codes import EXIT_CODES_HELP, ExitCode, error_line, exit_code
from tandem_client.options import (
    HelpFormatter,
    add_router_options,
    add_sampling_options,
    open_client,
    router_address,
    sampling_kwargs,
)
from tandem_client.results import ModelInfo
from tandem_client.sdk import TandemClient
from tandem_client.terminal import print_stream

Subparsers = Any  # argparse._SubParsersAction; private in argparse

PROMPT = ">>> "
COMMANDS_HELP = "/reset starts over, /exit or Ctrl-D quits, Ctrl-C stops an answer"

EXAMPLES = f"""\
examples:
  tandem chat                                   # the router at $TANDEM_ROUTER or :50050
  tandem chat --router 10.0.0.5:50050 --temperature 0.7 --max-tokens 512
  tandem chat --system "Answer in one sentence."
  printf 'Hi\\nAnd then?\\n' | tandem chat        # one turn per line; stops at an error

In the conversation: {COMMANDS_HELP}. A line of figures
follows each answer on stderr.

{EXIT_CODES_HELP}"""


def register_chat(subparsers: Subparsers) -> None:
    """Add `tandem chat`."""
    parser = subparsers.add_parser(
        "chat",
        help="talk with a served model, keeping the conversation",
        description="Talk with a model a running cluster serves (`tandem serve`). Each turn "
        "sends the conversation so far as chat messages, which the router renders with the "
        "model's chat template, and streams the answer.",
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    add_router_options(parser, timeout_s=600.0)
    parser.add_argument("--model", help="the served model to talk to (default: the router's first)")
    parser.add_argument(
        "--system",
        metavar="TEXT",
        help="a system message opening the conversation (/reset keeps it)",
    )
    add_sampling_options(parser)
    parser.set_defaults(func=_chat)


class Conversation:
    """The messages so far; a turn adds the question and its answer only once the answer
    is whole, so a failed or stopped turn leaves the conversation as it was."""

    def __init__(self, client: TandemClient, args: argparse.Namespace, model: str) -> None:
        self.client = client
        self.args = args
        self.model = model
        self.opening = [{"role": "system", "content": args.system}] if args.system else []
        self.messages: list[dict[str, str]] = list(self.opening)

    def reset(self) -> None:
        """Forget every turn (the system message stays)."""
        self.messages = list(self.opening)

    def turn(self, text: str) -> None:
        """Streams the answer to ``text`` after the conversation so far; its figures on
        stderr."""
        asked = [*self.messages, {"role": "user", "content": text}]
        started = time.perf_counter()
        chunks = self.client.stream(asked, model=self.model, **sampling_kwargs(self.args))
        streamed = print_stream(chunks, started)
        print(streamed.stats_line(), file=sys.stderr, flush=True)
        self.messages = [*asked, {"role": "assistant", "content": streamed.text}]


def _chat(args: argparse.Namespace) -> int:
    with open_client(args) as client:
        info = _pick_model(client, args.model)
        if info is None:
            return ExitCode.INVALID_REQUEST
        print(
            f"tandem chat: {info.name} at {router_address(args)} ({info.max_model_len} tokens "
            f"of context). {COMMANDS_HELP}.",
            file=sys.stderr,
        )
        return _converse(Conversation(client, args, info.name), args)


def _pick_model(client: TandemClient, name: str | None) -> ModelInfo | None:
    """The served model ``name`` (default: the router's first), or None (said on stderr)."""
    models = client.models()
    for info in models:
        if name in (None, info.name):
            return info
    served = ", ".join(m.name for m in models) or "none"
    print(
        f"tandem chat: error: the router does not serve the model {name!r} (it serves: "
        f"{served}); pass one of those with --model",
        file=sys.stderr,
    )
    return None


def _converse(conversation: Conversation, args: argparse.Namespace) -> int:
    """Reads and answers lines until /exit or the end of input. From a terminal an error
    ends only its turn; from a pipe it ends the chat with its exit code."""
    is_terminal = sys.stdin.isatty()
    if is_terminal:
        import readline  # noqa: F401  # line editing and history for input()

        # Ctrl-C stops an answer even when started from a shell's background job, which
        # leaves SIGINT ignored, so that Python never installs KeyboardInterrupt.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    while True:
        try:
            line = input(PROMPT).strip()
        except EOFError:  # Ctrl-D
            print(file=sys.stderr)
            return ExitCode.OK
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh line
            print(file=sys.stderr)
            continue
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return ExitCode.OK
        if line == "/reset":
            conversation.reset()
            print("(the conversation starts over)", file=sys.stderr, flush=True)
            continue
        if line.startswith("/"):
            print(f"unknown command {line.split()[0]}: {COMMANDS_HELP}", file=sys.stderr)
            continue
        try:
            conversation.turn(line)
        except KeyboardInterrupt:  # the stream is closed: the request is cancelled
            print("[answer stopped]", file=sys.stderr, flush=True)
        except TandemError as e:
            print(
                error_line("chat", e, router_address(args), args.timeout),
                file=sys.stderr,
                flush=True,
            )
            if not is_terminal:
                return exit_code(e)

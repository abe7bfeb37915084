"""`tandem generate`: through a running cluster's router, or in this process.

With ``--router`` the prompts go to a cluster over gRPC (no torch needed). Without it,
the prompts run on an engine in this process, which the server distribution provides
through the ``tandem.generate.in_process`` entry point: a callable
``add_arguments(parser) -> run(args)`` that adds its engine options and returns the
function that generates.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from typing import Any

import grpc  # type: ignore[import-untyped]  # no types-grpcio in the dev extra

from tandem.v1 import generation_pb2 as gen
from tandem_client.client import Prompt, generate, wait_until_serving

IN_PROCESS_GROUP = "tandem.generate.in_process"

Run = Callable[[argparse.Namespace], int]
Subparsers = Any  # argparse._SubParsersAction; private in argparse


def register_generate(subparsers: Subparsers) -> None:
    """Add `tandem generate`."""
    parser = subparsers.add_parser(
        "generate",
        help="generate text through a running cluster's router, or in-process",
        description="Send one or more prompts to a running cluster (`tandem serve`) with "
        "--router and print each answer as it streams, with its time to first token and "
        "tokens per second. Without --router, run the engine in this process (needs the "
        "tandem-server distribution) and print the answers, then the token count and "
        "throughput.",
    )
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text")
    parser.add_argument(
        "--router",
        metavar="HOST:PORT",
        help="generate through this router instead of in-process (the model, dtype and "
        "speculative options are then the cluster's business)",
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="with --router: wait up to this long for the router to be SERVING",
    )
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 means off")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--stop", action="append", default=[], metavar="STR", help="stop string (repeatable)"
    )
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence")
    parser.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap each prompt in the model's chat template (default: when it has one)",
    )
    in_process = _in_process(parser)
    parser.set_defaults(func=lambda args: _generate(args, in_process))


def _in_process(parser: argparse.ArgumentParser) -> Run | None:
    """The in-process engine's run function, its options added to ``parser``; None
    where no installed distribution provides one."""
    for ep in entry_points(group=IN_PROCESS_GROUP):
        group = parser.add_argument_group("in-process engine (without --router)")
        run: Run = ep.load()(group)
        return run
    return None


def _generate(args: argparse.Namespace, in_process: Run | None) -> int:
    if args.router:
        return generate_through_router(args)
    if in_process is None:
        print(
            "tandem generate: error: give --router HOST:PORT; generating in-process needs "
            "the tandem-server distribution (pip install tandem-server)",
            file=sys.stderr,
        )
        return 2
    return in_process(args)


def generate_through_router(args: argparse.Namespace) -> int:
    """`tandem generate --router HOST:PORT`: each prompt's answer printed as it streams,
    then tokens, time to first token and tokens per second."""
    params: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "stop": args.stop,
        "ignore_eos": args.ignore_eos,
    }
    if args.seed is not None:
        params["seed"] = args.seed
    deadline = time.monotonic() + args.wait
    try:
        wait_until_serving(args.router, args.wait)
        for text in args.prompts:
            prompt: Prompt = text if args.chat is False else [{"role": "user", "content": text}]
            print(f">>> {text}", flush=True)
            start = time.perf_counter()
            first = None
            num_tokens = 0
            for chunk in _retry_unavailable(args.router, prompt, params, deadline):
                if first is None and chunk.token_ids:
                    first = time.perf_counter() - start
                num_tokens += len(chunk.token_ids)
                print(chunk.text, end="", flush=True)
            elapsed = time.perf_counter() - start
            print(
                f"\n[{num_tokens} tokens in {elapsed:.2f} s, first after "
                f"{1e3 * (first or 0.0):.0f} ms, {num_tokens / elapsed:.1f} tok/s]\n",
                flush=True,
            )
    except grpc.RpcError as e:
        print(f"tandem generate: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except TimeoutError as e:
        print(f"tandem generate: error: {e}; is `tandem serve` running?", file=sys.stderr)
        return 1
    return 0


def _retry_unavailable(
    address: str, prompt: Prompt, params: dict[str, Any], deadline: float
) -> Iterator[gen.GenerateChunk]:
    """``generate``, tried again while the router answers UNAVAILABLE before any chunk
    (its workers are still starting) until ``deadline`` (monotonic)."""
    while True:
        chunks = generate(address, prompt, **params)
        try:
            first = next(chunks)
        except StopIteration:
            return
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(1.0)
            continue
        yield first
        yield from chunks
        return

"""`tandem loadtest`: the harness's command (a ``tandem.commands`` plugin of the
``tandem-client[loadtest]`` extra). Checks the options and the target, then runs the
warm-up and each rate of the sweep, and prints a table per run and one JSON line."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

from loadtest.data import (
    Lengths,
    RequestSpec,
    builtin_requests,
    cycle_prompts,
    random_requests,
    read_jsonl,
)
from loadtest.metrics import run_figures
from loadtest.options import DEFAULT_NUM_REQUESTS, DESCRIPTION, EXAMPLES, add_options
from loadtest.report import summary, table, to_json
from loadtest.runner import LoadShape, run_load, warm_up
from loadtest.targets import OpenAITarget, TandemTarget, Target, TargetUnavailable
from tandem_client.exit_codes import ExitCode
from tandem_client.options import HelpFormatter, router_address

Subparsers = Any  # argparse._SubParsersAction; private in argparse


def register_loadtest(subparsers: Subparsers) -> None:
    """Add `tandem loadtest`."""
    parser = subparsers.add_parser(
        "loadtest",
        help="measure a Tandem router or an OpenAI-compatible server under load",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    add_options(parser)
    parser.set_defaults(func=partial(run_command, parser=parser))


def request_source(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> Callable[[int], Iterator[RequestSpec]]:
    """A function of a seed giving the requests that ``args`` ask for; exit 2 naming the
    option for an unreadable or malformed --dataset or a wrong combination."""
    output_len = Lengths(args.output_len, args.range_ratio)
    if args.dataset == "random":
        input_len = Lengths(args.input_len, args.range_ratio)
        return lambda seed: random_requests(
            input_len, output_len,
            as_token_ids=args.target == "tandem",
            token_ids=args.token_ids,
            prefix_len=args.prefix_len,
            num_prefix_groups=args.num_prefix_groups,
            seed=seed,
        )  # fmt: skip
    if args.prefix_len:
        parser.error("argument --prefix-len: only with --dataset random")
    if args.dataset == "builtin":
        return lambda seed: builtin_requests(output_len, seed=seed)
    try:
        items = read_jsonl(Path(args.dataset))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        parser.error(f"argument --dataset: cannot read {args.dataset}: {e}")
    return lambda seed: cycle_prompts(items, output_len, seed=seed)


def open_target(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Target:
    if args.target == "tandem":
        token = args.token or os.environ.get("TANDEM_TOKEN") or None
        return TandemTarget(
            router_address(args), model=args.model, timeout_s=args.timeout, token=token
        )
    if not args.base_url:
        parser.error("argument --base-url: required with --target openai")
    return OpenAITarget(
        args.base_url,
        model=args.model,
        endpoint=args.endpoint,
        timeout_s=args.timeout,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
    )


def _missing_extras(args: argparse.Namespace) -> list[str]:
    """The packages of the loadtest extra this run needs and cannot import."""
    needed = ["tqdm"] + (["openai"] if args.target == "openai" else [])
    return [name for name in needed if importlib.util.find_spec(name) is None]


def run_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`tandem loadtest`: the exit code (0 when every run completed a request)."""
    missing = _missing_extras(args)
    if missing:
        parser.error(f"needs {', '.join(missing)}: pip install 'tandem-client[loadtest]'")
    source = request_source(args, parser)
    num_requests = args.num_requests
    if num_requests is None and args.duration is None:
        num_requests = DEFAULT_NUM_REQUESTS
    shapes = [
        LoadShape(rate, args.burstiness, args.concurrency, num_requests, args.duration, args.seed)
        for rate in args.request_rate
    ]
    show_progress = sys.stderr.isatty() if args.progress is None else args.progress
    try:
        runs = asyncio.run(_run(args, parser, source, shapes, show_progress))
    except TargetUnavailable as e:
        print(f"tandem loadtest: error: {e}; no load sent", file=sys.stderr)
        return e.code
    for run in runs:
        print(table(run), end="\n\n")
    where = args.base_url if args.target == "openai" else router_address(args)
    described = {"target": args.target, "address": where, "model": args.model}
    if args.target == "openai":
        described["endpoint"] = args.endpoint
    line = to_json(summary(described, runs))
    if args.output is not None:
        args.output.write_text(line + "\n")
    print(line, flush=True)
    failed = [run for run in runs if run["num_completed"] == 0]
    if failed:
        print(
            f"tandem loadtest: error: no request completed ({failed[0]['errors']})",
            file=sys.stderr,
        )
        return ExitCode.ERROR
    return ExitCode.OK


async def _run(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    source: Callable[[int], Iterator[RequestSpec]],
    shapes: list[LoadShape],
    show_progress: bool,
) -> list[dict[str, Any]]:
    target = open_target(args, parser)
    try:
        await target.check()
        args.model = target.model
        if args.warmup:
            await warm_up(
                target, source(args.seed + 1), args.warmup, args.concurrency,
                ignore_eos=args.ignore_eos,
            )  # fmt: skip
        runs = []
        slos = dict(args.slo)
        for shape in shapes:
            result = await run_load(
                target, source(args.seed), shape, ignore_eos=args.ignore_eos,
                show_progress=show_progress,
            )  # fmt: skip
            figures = run_figures(result.records, result.duration_s, slos)
            runs.append(
                {
                    "request_rate": shape.rate,
                    "burstiness": shape.burstiness,
                    "concurrency": shape.concurrency,
                    "slos": slos,
                    **figures,
                }
            )
        return runs
    finally:
        await target.close()

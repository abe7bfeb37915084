"""`tandem loadtest`: the harness's command (a ``tandem.commands`` plugin of the
``tandem-client[loadtest]`` extra). Checks the options and the target, then runs the
warm-up and each rate of the sweep; shows a summary on stderr, writes the files of
--output-dir, and prints one JSON line."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from loadtest.data import (
    Lengths,
    RequestSpec,
    builtin_requests,
    cycle_prompts,
    edit_requests,
    random_requests,
    read_jsonl,
)
from loadtest.metrics import run_figures
from loadtest.options import DEFAULT_NUM_REQUESTS, DESCRIPTION, EXAMPLES, add_options
from loadtest.output import write_outputs
from loadtest.report import print_summary, summary, to_json
from loadtest.runner import LoadShape, RunResult, run_load, warm_up
from loadtest.speculative import SpecCounts, scrape
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
    if args.dataset == "edit":
        return lambda seed: edit_requests(output_len, seed=seed)
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
    needed = ["tqdm", "rich"] + (["openai"] if args.target == "openai" else [])
    if args.output_dir is not None and args.plots:
        needed.append("matplotlib")
    return [name for name in needed if importlib.util.find_spec(name) is None]


@dataclass
class Measured:
    """What the runs gave: each run's figures (the JSON's ``runs``) and its requests."""

    runs: list[dict[str, Any]] = field(default_factory=list)
    results: list[RunResult] = field(default_factory=list)


def run_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`tandem loadtest`: the exit code (0 when every run completed a request)."""
    from rich.console import Console

    missing = _missing_extras(args)
    if missing:
        parser.error(f"needs {', '.join(missing)}: pip install 'tandem-client[loadtest]'")
    source = request_source(args, parser)
    if args.output_dir is not None:
        try:
            args.output_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            parser.error(f"argument --output-dir: cannot create {args.output_dir}: {e}")
    num_requests = args.num_requests
    if num_requests is None and args.duration is None:
        num_requests = DEFAULT_NUM_REQUESTS
    shapes = [
        LoadShape(rate, args.burstiness, args.concurrency, num_requests, args.duration, args.seed)
        for rate in args.request_rate
    ]
    show_progress = sys.stderr.isatty() if args.progress is None else args.progress
    try:
        measured = asyncio.run(_run(args, parser, source, shapes, show_progress))
    except TargetUnavailable as e:
        print(f"tandem loadtest: error: {e}; no load sent", file=sys.stderr)
        return e.code
    where = args.base_url if args.target == "openai" else router_address(args)
    described = {"target": args.target, "address": where, "model": args.model}
    if args.target == "openai":
        described["endpoint"] = args.endpoint
    result = summary(described, measured.runs)
    print_summary(
        Console(stderr=True), f"{args.target} {where} ({args.model or 'default model'})",
        measured.runs,
    )  # fmt: skip
    line = to_json(result)
    if args.output is not None:
        args.output.write_text(line + "\n")
    if args.output_dir is not None:
        records = [r.records for r in measured.results]
        written = write_outputs(
            args.output_dir, result, records, [r.start for r in measured.results]
        )
        if args.plots:
            from loadtest.plots import write_plots

            written += write_plots(args.output_dir, measured.runs, records)
        print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    print(line, flush=True)
    failed = [run for run in measured.runs if run["num_completed"] == 0]
    if failed:
        print(
            f"tandem loadtest: error: no request completed ({failed[0]['errors']})",
            file=sys.stderr,
        )
        return ExitCode.ERROR
    return ExitCode.OK


async def _scrape(urls: list[str]) -> SpecCounts:
    """The decode workers' speculative counters; TargetUnavailable for one that does not
    answer (before the load: no load sent)."""
    try:
        return await asyncio.to_thread(scrape, urls)
    except (OSError, ValueError) as e:
        raise TargetUnavailable(f"--metrics-url {e}") from None


async def _scrape_or_warn(urls: list[str]) -> SpecCounts | None:
    """The counters, or None after a warning on stderr when a worker does not answer once
    the load has begun (the run is reported, without accepted tokens per step)."""
    try:
        return await _scrape(urls)
    except TargetUnavailable as e:
        print(f"tandem loadtest: warning: {e}; accepted tokens not reported", file=sys.stderr)
        return None


async def _run(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    source: Callable[[int], Iterator[RequestSpec]],
    shapes: list[LoadShape],
    show_progress: bool,
) -> Measured:
    target = open_target(args, parser)
    try:
        await target.check()
        args.model = target.model
        if args.metrics_url:
            await _scrape(args.metrics_url)  # answers before any load is sent
        if args.warmup:
            await warm_up(
                target, source(args.seed + 1), args.warmup, args.concurrency,
                ignore_eos=args.ignore_eos,
            )  # fmt: skip
        measured = Measured()
        slos = dict(args.slo)
        for shape in shapes:
            before = await _scrape_or_warn(args.metrics_url) if args.metrics_url else None
            result = await run_load(
                target, source(args.seed), shape, ignore_eos=args.ignore_eos,
                show_progress=show_progress,
            )  # fmt: skip
            figures = run_figures(result.records, result.duration_s, slos)
            if args.metrics_url:
                after = await _scrape_or_warn(args.metrics_url)
                delta = after - before if after is not None and before is not None else None
                figures["speculative"] = delta.figures("metrics") if delta is not None else None
            measured.results.append(result)
            measured.runs.append(
                {
                    "request_rate": shape.rate,
                    "burstiness": shape.burstiness,
                    "concurrency": shape.concurrency,
                    "slos": slos,
                    **figures,
                }
            )
        return measured
    finally:
        await target.close()

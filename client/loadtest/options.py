"""`tandem loadtest`'s options: the help text (with the metrics' definitions), each
option, and the argument types that refuse a bad value naming the option (exit 2)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from loadtest.metrics import SLO_KEYS
from loadtest.output import CSV_FILE, REQUESTS_FILE, SUMMARY_FILE
from loadtest.plots import CDF_FILE, SWEEP_FILE
from tandem_client.exit_codes import EXIT_CODES_HELP

DEFAULT_NUM_REQUESTS = 100  # without --num-requests or --duration

DESCRIPTION = """\
Measure a server under load: a Tandem router over gRPC (--target tandem) or any
OpenAI-compatible server over HTTP (--target openai), with the same requests, arrivals and
metrics, so that one run compares Tandem with another server. The target must answer a
health (gRPC) or /models (HTTP) check first. Requests stream, at temperature 0.

Arrivals: with --request-rate, requests start at random times (gamma-distributed gaps of
mean 1/rate, shape --burstiness: 1 is a Poisson process, as in `vllm bench serve`); with
--concurrency, at most that many are in flight (alone: a closed loop, each ending request
replaced at once). A comma-separated list of rates is a sweep: each rate runs in turn with
the same requests and is reported on its own. --warmup requests run first and are not
counted.

Metrics, in ms, each as mean, p50, p90 and p99 over the completed requests:
  TTFT  time to first token: the first chunk's arrival minus the request's start.
  ITL   inter-token latency: the gap between a chunk and the one before, shared evenly
        among the chunk's tokens (a chunk carries several under speculative decoding:
        3 tokens 30 ms after the previous chunk are three ITLs of 10 ms). Over HTTP, where
        an event does not say how many tokens it carries, the usage's completion tokens
        are shared evenly among the events.
  TPOT  time per output token, per request: (E2E - TTFT) / (tokens - 1).
  E2E   end-to-end latency: the stream's end minus the request's start.
Throughput: completed requests and their output tokens per second of the run (first start
to last end). Goodput: completed requests per second that meet every --slo. Errors are
counted by status code (a gRPC code name, an HTTP status).

Accepted tokens per step (speculative decoding): draft tokens accepted per verifying step,
from each request's usage over gRPC, or from --metrics-url before and after each run; also
tokens per step (that + 1) and the acceptance rate (accepted / drafted).

Output: a progress bar and, at the end, a summary screen on stderr; as the last line of
stdout one JSON object: the target and "runs", a list of each run's figures (one per rate).
--output-dir adds per-request JSONL, the summary as JSON and CSV, and PNG plots.

Exit codes: 3 when the target fails its check (no load is sent), 4 when it does not serve
--model, 7 when it refuses the credentials (3 too for a --metrics-url that does not
answer), 1 when a run completed no request, 2 for a bad
option; 0 otherwise, failed requests counted in the report."""

EXAMPLES = f"""\
examples:
  tandem loadtest --router 127.0.0.1:50050 --num-requests 200 --concurrency 8 --ignore-eos
  tandem loadtest --request-rate 1,2,4 --duration 60 --burstiness 0.5 --output-dir sweep/
  tandem loadtest --input-len 512 --output-len 128 --range-ratio 0.2 --prefix-len 256 \\
      --num-prefix-groups 4 --request-rate 2 --num-requests 100 --warmup 4
  tandem loadtest --target openai --base-url http://127.0.0.1:8080/v1 --model smollm2 \\
      --endpoint chat --dataset builtin --concurrency 4 --slo ttft_ms=500 --slo tpot_ms=50
  tandem loadtest --target openai --base-url http://127.0.0.1:8000/v1 --dataset chats.jsonl
  tandem loadtest --concurrency 8 --ignore-eos --metrics-url http://127.0.0.1:9101/metrics \\
      --output-dir results/

{EXIT_CODES_HELP}"""


def add_options(parser: argparse.ArgumentParser) -> None:
    """Every option of `tandem loadtest`, in groups: target, load, data, output."""
    target = parser.add_argument_group("target")
    target.add_argument(
        "--target",
        choices=("tandem", "openai"),
        default="tandem",
        help="tandem: a router over gRPC (--router); openai: any OpenAI-compatible server "
        "over HTTP (--base-url) (default: tandem)",
    )
    target.add_argument(
        "--router",
        metavar="HOST:PORT",
        help="the router's address (default: $TANDEM_ROUTER if set, else 127.0.0.1:50050)",
    )
    target.add_argument(
        "--token", help="bearer token for a router that requires one (default: $TANDEM_TOKEN)"
    )
    target.add_argument(
        "--base-url", metavar="URL", help="with --target openai: e.g. http://127.0.0.1:8000/v1"
    )
    target.add_argument(
        "--api-key", help="with --target openai (default: $OPENAI_API_KEY if set, else none)"
    )
    target.add_argument(
        "--model",
        default="",
        help="the served model to ask (default: the router's default; over HTTP the first "
        "that /models lists)",
    )
    target.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        default="completions",
        help="with --target openai: /chat/completions or /completions (default: completions)",
    )
    target.add_argument(
        "--timeout",
        type=positive_float,
        default=600.0,
        metavar="SECONDS",
        help="each request's deadline (default: 600)",
    )

    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=rates,
        default=[math.inf],
        metavar="RATE[,RATE...]",
        help="requests per second on average, open loop; 'inf' sends all at once (bounded "
        "by --concurrency); a comma-separated list is a sweep (default: inf)",
    )
    load.add_argument(
        "--burstiness",
        type=positive_float,
        default=1.0,
        help="shape of the gamma-distributed gaps between starts: 1 is Poisson, < 1 "
        "burstier, > 1 more regular (default: 1)",
    )
    load.add_argument(
        "--concurrency",
        type=positive_int,
        metavar="N",
        help="at most N requests in flight; without --request-rate a closed loop of N",
    )
    load.add_argument(
        "--num-requests",
        type=positive_int,
        metavar="N",
        help=f"requests per run (default: {DEFAULT_NUM_REQUESTS} unless --duration)",
    )
    load.add_argument(
        "--duration",
        type=positive_float,
        metavar="SECONDS",
        help="a run's length: at a --request-rate, every arrival planned within it is sent "
        "(late, if the machine or --concurrency holds it back); in a closed loop, none starts "
        "after it. Requests in flight finish",
    )
    load.add_argument(
        "--warmup",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="requests sent first and not counted (default: 0)",
    )
    load.add_argument(
        "--seed", type=int, default=0, help="seed of the arrivals and the data (default: 0)"
    )

    data = parser.add_argument_group("data")
    data.add_argument(
        "--dataset",
        default="random",
        metavar="random|builtin|edit|FILE.jsonl",
        help="random: prompts of --input-len random tokens (token ids over gRPC, text of "
        "about as many words over HTTP); builtin: one-turn chats about Python's own module "
        "docstrings (no download); edit: one-turn chats asking for a function of Python's "
        "standard library back with one small change (answers that repeat the prompt, "
        "where model-free drafts win); a JSONL file: one object a line with 'prompt' (text) "
        "or 'messages' (a chat), and optionally 'max_tokens' (default: random)",
    )
    data.add_argument(
        "--input-len", type=positive_int, default=128, help="prompt tokens (default: 128)"
    )
    data.add_argument(
        "--output-len",
        type=positive_int,
        default=64,
        help="tokens to generate, max_tokens (default: 64)",
    )
    data.add_argument(
        "--range-ratio",
        type=ratio,
        default=0.0,
        help="lengths uniform within +-this fraction of --input-len and --output-len, "
        "e.g. 0.2 (default: 0, fixed)",
    )
    data.add_argument(
        "--prefix-len",
        type=non_negative_int,
        default=0,
        help="random data: a shared prefix of this many tokens before each prompt (prefix "
        "caching) (default: 0)",
    )
    data.add_argument(
        "--num-prefix-groups",
        type=positive_int,
        default=1,
        help="random data: distinct shared prefixes, used in turn (default: 1)",
    )
    data.add_argument(
        "--token-ids",
        type=id_range,
        default=(100, 1000),
        metavar="LOW:HIGH",
        help="random data: token ids drawn from [LOW, HIGH), which must be in the model's "
        "vocabulary (default: 100:1000)",
    )
    data.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate --output-len tokens whatever the model says (sent as ignore_eos, "
        "in the body over HTTP)",
    )

    out = parser.add_argument_group("output")
    out.add_argument(
        "--slo",
        type=slo,
        action="append",
        default=[],
        metavar="KEY=MS",
        help=f"a service-level objective for goodput, repeatable; KEY one of {', '.join(SLO_KEYS)}"
        " (e.g. --slo ttft_ms=500 --slo tpot_ms=50)",
    )
    out.add_argument("--output", type=Path, metavar="FILE", help="also write the JSON there")
    out.add_argument(
        "--output-dir",
        type=output_dir,
        metavar="DIR",
        help=f"write {REQUESTS_FILE} (one line per request: chunks, latencies, tokens), "
        f"{SUMMARY_FILE} (the JSON line), {CSV_FILE} (a row per run) and, unless --no-plots, "
        f"{CDF_FILE} (TTFT, ITL and E2E CDFs) and, for a sweep, {SWEEP_FILE}; created if "
        "missing",
    )
    out.add_argument(
        "--plots",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --output-dir: the PNG plots (matplotlib) (default: on)",
    )
    out.add_argument(
        "--metrics-url",
        type=http_url,
        action="append",
        default=[],
        metavar="URL",
        help="a decode worker's Prometheus /metrics, repeatable: accepted tokens per step from "
        "its speculative counters, read before and after each run (every client's requests "
        "meanwhile count); without it, from each request's usage (gRPC only)",
    )
    out.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a progress bar on stderr (default: when stderr is a terminal)",
    )


# Argument types: argparse turns their ValueError into "argument --x: invalid ..." (exit 2).


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def ratio(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def rates(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers separated by commas, got {text!r}"
        ) from None
    if any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"each rate must be > 0 (or inf), got {text}")
    return values


def slo(text: str) -> tuple[str, float]:
    key, sep, value = text.partition("=")
    if not sep or key not in SLO_KEYS:
        raise argparse.ArgumentTypeError(
            f"expected KEY=MS with KEY one of {SLO_KEYS}, got {text!r}"
        )
    return key, positive_float(value)


def output_dir(text: str) -> Path:
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a directory")
    return path


def http_url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected an http:// or https:// URL, got {text!r}")
    return text


def id_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    try:
        values = int(low), int(high)
    except ValueError:
        values = (0, 0)
    if not sep or not 0 <= values[0] < values[1]:
        raise argparse.ArgumentTypeError(f"expected LOW:HIGH with 0 <= LOW < HIGH, got {text!r}")
    return values
